"""PyTorch's side of the training-step microbenchmark: the MLP 784-256-10, Adam (lr 1e-3,
eps 1e-5 as burn's), cross-entropy, batch 32 (64 random batches, random labels), the loss read back every step (as the Anchorage
client does), median of 2,000 steps after 200 of warm-up; and torch's f32 matmul rate on a
1024³ product (best of 5). Prints one JSON line.

    python torch_step.py THREADS
"""

import json
import sys
import time

import torch
from torch import nn

threads = int(sys.argv[1])
torch.set_num_threads(threads)
torch.manual_seed(1)
# 64 random batches with random labels, the model and optimiser afresh every 200 steps (outside
# the timing), as on the Anchorage side: one batch for thousands of steps drives the gradients
# into subnormal floats.
batches = [(torch.rand(32, 784), torch.randint(0, 10, (32,))) for _ in range(64)]
loss_fn = nn.CrossEntropyLoss()
times = []
for i in range(2200):
    if i % 200 == 0:
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    x, y = batches[i % len(batches)]
    t = time.perf_counter()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    loss.item()
    if i >= 200:
        times.append((time.perf_counter() - t) * 1e3)
times.sort()
step_ms = times[len(times) // 2]

n = 1024
a, b = torch.rand(n, n), torch.rand(n, n)
a @ b
best = min(
    (lambda t0: (a @ b, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5)
)
gflops = 2 * n**3 / best / 1e9
flop = 2 * (2 * 32 * (784 * 256 + 256 * 10)) + 2 * 32 * 256 * 10
print(
    json.dumps(
        {
            "threads": torch.get_num_threads(),
            "step_ms": step_ms,
            "matmul_gflops": gflops,
            "step_fraction_of_matmul": flop / (step_ms / 1e3) / 1e9 / gflops,
            "torch": torch.__version__,
        }
    )
)
