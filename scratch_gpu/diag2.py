import time, torch
import selfattn
import selfattn.attention as A
from selfattn.positional import build
torch.manual_seed(0)
n = 4096
def timeit(f, k=4):
    f(); ts = []
    for _ in range(k):
        torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return round(1000 * sorted(ts)[len(ts)//2], 2)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, n, 512, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(2, n, 512, device="cuda", dtype=dtype)
    base = selfattn.MultiHeadAttention(512, 8).cuda().to(dtype)
    fb = timeit(lambda: base(x, x, x).backward(g))
    with torch.no_grad(): ff = timeit(lambda: base(x, x, x))
    print(dtype, "flash fwd", ff, "fwd+bwd", fb, flush=True)
    for name in ("alibi", "t5", "kerple"):
        for route in ("flex", "blockwise"):
            A.flex_applies = (lambda q, v: q.device.type == "cuda" and min(q.shape[-1], v.shape[-1]) >= 16) if route == "flex" else (lambda q, v: False)
            mha = selfattn.MultiHeadAttention(512, 8, position=build(name, num_hiddens=512, num_heads=8)).cuda().to(dtype)
            try:
                with torch.no_grad(): f = timeit(lambda: mha(x, x, x))
                b = timeit(lambda: mha(x, x, x).backward(g))
                print(dtype, name, route, "fwd x%.2f" % (f / ff), "fwd+bwd x%.2f" % (b / fb), flush=True)
            except Exception as e:
                print(dtype, name, route, "failed", type(e).__name__, str(e)[:200], flush=True)
