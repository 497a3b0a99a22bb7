import time, torch, sys
import selfattn
from selfattn.positional import build
torch.manual_seed(0)
n = 4096
x = torch.randn(2, n, 512, device="cuda", requires_grad=True)
g = torch.randn(2, n, 512, device="cuda")
def timeit(f, k=5):
    ts = []
    for _ in range(k):
        torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    return [round(1000 * t, 2) for t in ts]
base = selfattn.MultiHeadAttention(512, 8).cuda()
print("flash fwd+bwd", timeit(lambda: base(x, x, x).backward(g)), flush=True)
for name in ("alibi", "t5", "kerple"):
    mha = selfattn.MultiHeadAttention(512, 8, position=build(name, num_hiddens=512, num_heads=8)).cuda()
    with torch.no_grad():
        print(name, "fwd", timeit(lambda: mha(x, x, x)), flush=True)
    print(name, "fwd+bwd", timeit(lambda: mha(x, x, x).backward(g)), flush=True)
# direct flex with a constant bias, no grad params
from torch.nn.attention.flex_attention import flex_attention
fa = torch.compile(flex_attention)
q = torch.randn(2, 8, n, 64, device="cuda", requires_grad=True)
slopes = torch.rand(8, device="cuda")
def sm(s, b, h, qi, ki): return s - slopes[h] * (qi - ki).abs()
print("raw flex alibi fwd+bwd", timeit(lambda: fa(q, q, q, score_mod=sm).sum().backward()), flush=True)
print("raw sdpa fwd+bwd", timeit(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()), flush=True)
