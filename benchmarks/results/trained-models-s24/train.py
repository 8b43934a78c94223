"""Train a tiny byte-level decoder on Python stdlib sources. python train.py ARCH STEPS"""
import glob, math, os, sys, time, torch
from transformers import AutoConfig, AutoModelForCausalLM
torch.set_num_threads(2)
arch, steps = sys.argv[1], int(sys.argv[2])
H, L, CTX, B = 128, int(os.environ.get("LAYERS", 4)), 128, 32
files = sorted(glob.glob("/usr/lib/python3.11/**/*.py", recursive=True))
data = b"".join(open(f, "rb").read() for f in files)[:20_000_000]
data = torch.tensor(list(data), dtype=torch.long) + 3  # 0 pad, 1 bos, 2 eos
VOCAB = 264
heads = 4; hd = H // heads
kw = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=H, num_hidden_layers=L,
          num_attention_heads=heads, intermediate_size=4 * H, max_position_embeddings=512, num_key_value_heads=2)
extra = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": hd},
         "gemma2": {"head_dim": hd, "sliding_window": 32, "query_pre_attn_scalar": hd},
         "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 2 * H},
         "qwen3_moe": {"head_dim": hd, "moe_intermediate_size": H, "num_experts": 4, "num_experts_per_tok": 2,
                       "decoder_sparse_step": 1, "mlp_only_layers": []}}[arch]
kw.update(extra)
cfg = AutoConfig.for_model(arch, **kw)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa" if arch != "gemma2" else "eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
g = torch.Generator().manual_seed(1)
t0 = time.time(); ema = None
for step in range(steps):
    lr = 2e-3 * min(1, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
    for pg in opt.param_groups: pg["lr"] = lr
    idx = torch.randint(0, len(data) - CTX - 1, (B,), generator=g)
    x = torch.stack([data[i:i + CTX] for i in idx])
    if os.environ.get('BOS'): x = torch.cat([torch.ones(B, 1, dtype=torch.long), x[:, :-1]], 1)
    out = model(input_ids=x, labels=x)
    opt.zero_grad(); out.loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    ema = out.loss.item() if ema is None else 0.95 * ema + 0.05 * out.loss.item()
    if step % 100 == 0 or step == steps - 1:
        print(f"{arch} step {step} loss {ema:.3f} t {time.time()-t0:.0f}s", flush=True)
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0
model.save_pretrained(f"/tmp/tm/models/{arch}" + os.environ.get("SUFFIX", ""))
print("saved", arch, "final ema loss", round(ema, 3), flush=True)
