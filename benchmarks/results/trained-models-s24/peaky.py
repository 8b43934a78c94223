import json, sys, torch
sys.path.insert(0, "/tmp/tm")
from tm import text_prompt
from transformers import AutoModelForCausalLM
torch.set_num_threads(2)
name = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(f"/tmp/tm/models/{name}", attn_implementation="eager").eval()
ids = torch.tensor([text_prompt(128, s) for s in range(8)])
with torch.no_grad():
    out = m(ids, output_attentions=True, output_hidden_states=True, labels=ids)
res = {"model": name, "heldout_loss": round(out.loss.item(), 3), "layers": []}
for l, att in enumerate(out.attentions):
    a = att[:, :, 16:, :]  # query rows >= 16 (enough keys to be peaky or not)
    mx = a.max(-1).values
    h = out.hidden_states[l + 1]
    rms = h.pow(2).mean(-1).sqrt()
    res["layers"].append({"layer": l, "mean_max_w": round(mx.mean().item(), 3), "p90_max_w": round(mx.quantile(0.9).item(), 3),
        "frac_gt_0.9": round((mx > 0.9).float().mean().item(), 3), "frac_gt_0.99": round((mx > 0.99).float().mean().item(), 3),
        "sink_w_pos0": round(a[..., 0].mean().item(), 3),
        "hidden_absmax_over_median_rms": round((h.abs().max() / rms.median()).item(), 1)})
print(json.dumps(res))
