"""Same-machine A/B: current decode attention (split + merge) vs e8cad50's direct one-split write,
and the current kernel at forced split counts. 8B shape (32/8/128), bf16, page 16."""
import importlib.util, math, sys, json, os
import torch, triton.testing
from localrun import kernels as K
from localrun.kernels import decode_attention as cur
spec = importlib.util.spec_from_file_location("localrun.kernels.decode_direct", ".dev/decode_direct.py")
direct = importlib.util.module_from_spec(spec); sys.modules[spec.name] = direct; spec.loader.exec_module(direct)
dev, dt = "cuda", torch.bfloat16
hq, hkv, d, page = 32, 8, 128, 16
scale = d ** -0.5
rows = []
def paged(lens):
    pages = [math.ceil(n / page) for n in lens]
    perm = torch.randperm(sum(pages), device=dev).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev); used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]; used += n
    kc = torch.randn(sum(pages), page, hkv, d, dtype=dt, device=dev)
    return kc, torch.randn_like(kc), table, torch.tensor(lens, dtype=torch.int32, device=dev)
def t(fn):
    return float(triton.testing.do_bench_cudagraph(fn, rep=60))
for B, L in [(64, 1024), (64, 4096), (128, 1024), (128, 4096), (256, 512), (256, 1024), (256, 2048)]:
    kc, vc, table, lens = paged([L] * B)
    q = torch.randn(B, hq, d, dtype=dt, device=dev)
    per = (2 * B * L * hkv * d + 2 * B * hq * d) * 2
    layers = max(1, min(32, math.ceil((512 << 20) / per)))
    caches = [(kc, vc)] + [(torch.randn_like(kc), torch.randn_like(vc)) for _ in range(layers - 1)]
    ref = cur.paged_decode_attention(q, kc, vc, table, lens, scale)
    err = float((direct.paged_decode_attention(q, kc, vc, table, lens, scale) - ref).float().abs().max())
    res = {"B": B, "L": L, "layers": layers, "direct_maxdiff": err, "splits_default": cur.default_num_kv_splits(B, hkv, q)}
    variants = {"cur": lambda: [cur.paged_decode_attention(q, k, v, table, lens, scale) for k, v in caches],
                "direct": lambda: [direct.paged_decode_attention(q, k, v, table, lens, scale) for k, v in caches]}
    for s in (1, 2, 4):
        variants[f"cur_s{s}"] = (lambda s=s: [cur.paged_decode_attention(q, k, v, table, lens, scale, s) for k, v in caches])
    for rnd in range(2):
        for name, fn in variants.items():
            ms = t(fn)
            res.setdefault(name, []).append(round(per * layers / (ms / 1e3) / 1e9, 1))
    print(json.dumps(res), flush=True); rows.append(res)
    del kc, vc, caches; torch.cuda.empty_cache()
json.dump(rows, open(os.environ.get("OUT", ".") + "/decode_ab.json", "w"), indent=1)
