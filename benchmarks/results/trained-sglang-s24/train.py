"""Train a tiny byte-level decoder (ids = byte + 3) on stdlib sources. python train.py ARCH STEPS OUT"""
import glob, math, os, sys, time, torch
sys.path.insert(0, "/work/main/examples")
from tiny_models import make_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM
torch.set_num_threads(int(os.environ.get("THREADS", 2)))
arch, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
H, L, CTX, B = 128, 4, 128, 32
files = sorted(glob.glob("/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"))
data = b"".join(open(f, "rb").read() for f in files)[:8_000_000]
data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + 3
hold = data[-200_000:]; data = data[:-200_000]
VOCAB = 259
kw = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=H, num_hidden_layers=L,
          num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * H, max_position_embeddings=512,
          tie_word_embeddings=False)
if arch == "qwen3": kw["head_dim"] = 32
cfg = AutoConfig.for_model(arch, **kw)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))
g = torch.Generator().manual_seed(1)
t0 = time.time(); ema = None
for step in range(steps):
    lr = 2e-3 * min(1, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
    for pg in opt.param_groups: pg["lr"] = lr
    idx = torch.randint(0, len(data) - CTX - 1, (B,), generator=g)
    x = torch.stack([data[i:i + CTX] for i in idx])
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
    if step % 100 == 0 or step == steps - 1:
        print(f"{arch} step {step} loss {ema:.3f} t {time.time()-t0:.0f}s", flush=True)
model.eval()
model.config._attn_implementation = "eager"
wins = torch.stack([hold[s:s + 128] for s in torch.randint(0, len(hold) - 128, (8,), generator=g)])
with torch.no_grad():
    o = model(input_ids=wins, labels=wins, output_attentions=True)
print("held-out loss", round(o.loss.item(), 3))
for i, a in enumerate(o.attentions):
    top = a[..., 16:, :].max(-1).values
    print(f"layer {i}: mean max w {top.mean():.3f}  rows>0.9 {(top > 0.9).float().mean():.3f}  rows>0.99 {(top > 0.99).float().mean():.3f}")
model.config._attn_implementation = "sdpa"
model.config.dtype = "float32"
model.generation_config.eos_token_id = None
model.save_pretrained(out)
make_tokenizer(VOCAB).save_pretrained(out)
torch.save(hold[:20000].clone(), os.path.join(out, "heldout_ids.pt"))
print("saved", out, flush=True)
