"""Weight-sync throughput: each strategy against a raw gloo broadcast of the same bytes, in one run.

Two processes (a trainer rank and a generation rank) join a gloo process group, as the Ray
backend's workers do. Both hold the state dict of a real HF causal LM of >= 100 M parameters
(random init; the receiver starts from other weights). Before each round of syncs the trainer
changes ``--density`` of the elements (what a train step touches), then each strategy runs:

- ``raw``: one broadcast of a flat buffer of the state's size (the yardstick);
- ``full``: a broadcast per tensor;
- ``bucketed``: 64 MiB flat buckets, kept between syncs and pipelined (flowrl.runtime.weightsync.BucketedSync);
- ``sparse``: only changed elements as (index, value) pairs (after a first full sync).

After every sync the receiver's tensors are checked bit for bit against the trainer's. Bytes/s
is the model's state bytes over the sync's median seconds (for sparse: the bytes it stands
for, and the bytes it actually sent). The last line is JSON.

    python benchmarks/weight_sync.py --hidden 768 --layers 12 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model_state(hidden: int, layers: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 64, 1),
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _perturb(state: dict[str, torch.Tensor], density: float, gen: torch.Generator) -> None:
    for t in state.values():
        flat = t.view(-1)
        n = max(1, int(flat.numel() * density))
        idx = torch.randint(0, flat.numel(), (n,), generator=gen)
        flat[idx] += 1e-3


def _worker(rank: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    from flowrl.runtime import weightsync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # a dedicated channel, as the backend makes per synced model
    state = _model_state(args.hidden, args.layers, args.vocab, seed=0 if rank == 0 else 1)
    nbytes = weightsync.state_bytes(state)
    params = sum(t.numel() for t in state.values())
    gen = torch.Generator().manual_seed(0)
    sparse = weightsync.SparseSync()
    bucketed = weightsync.BucketedSync()
    raw = torch.zeros(nbytes, dtype=torch.uint8)  # allocated once, as the strategies' tensors are
    results: dict[str, list[float]] = {}
    sent: dict[str, int] = {}
    run = {
        "raw": lambda: weightsync.sync_raw(raw, 0, group),
        "full": lambda: weightsync.sync_full(state, 0, group),
        "bucketed": lambda: bucketed(state, 0, group),
        "sparse": lambda: sparse(state, 0, group),
    }
    exact = True
    sparse(state, 0, group)  # the first sparse sync sends everything; later ones send changes
    for _ in range(args.repeats):
        if rank == 0:  # one train step's changes; every strategy then moves them
            _perturb(state, args.density, gen)
        for name, fn in run.items():  # interleaved, so drift on a noisy box hits every strategy alike
            dist.barrier(group)
            t0 = time.perf_counter()
            sent[name] = fn()
            results.setdefault(name, []).append(time.perf_counter() - t0)
            if name != "raw":  # the receiver now holds the trainer's tensors, bit for bit
                ref = {k: v.clone() for k, v in state.items()}
                for t in ref.values():
                    dist.broadcast(t, src=0, group=group)
                if rank == 1:
                    exact &= all(torch.equal(ref[k].view(torch.uint8), state[k].view(torch.uint8)) for k in ref)
    if rank == 1:
        queue.put(
            {
                "params": params,
                "bytes": nbytes,
                "seconds": {k: statistics.median(v) for k, v in results.items()},
                "sent": sent,
                "density": sparse.density,
                "exact": exact,
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--density", type=float, default=0.1, help="fraction of elements a step changes")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get(timeout=3600)
    for p in procs:
        p.join()
    gbps = {k: out["bytes"] / v / 1e9 for k, v in out["seconds"].items()}
    print(f"model: {out['params'] / 1e6:.1f}M parameters, {out['bytes'] / 2**20:.0f} MiB (fp32)")
    for name, secs in out["seconds"].items():
        extra = f", sent {out['sent'][name] / 2**20:.0f} MiB" if name == "sparse" else ""
        print(f"  {name:<9} {secs:7.3f} s  {gbps[name]:6.2f} GB/s  {gbps[name] / gbps['raw']:6.1%} of raw{extra}")
    print(
        json.dumps(
            {
                "benchmark": "weight_sync",
                "params_m": round(out["params"] / 1e6, 1),
                "state_mib": round(out["bytes"] / 2**20, 1),
                "gb_per_s": {k: round(v, 3) for k, v in gbps.items()},
                "of_raw": {k: round(v / gbps["raw"], 3) for k, v in gbps.items() if k != "raw"},
                "sparse_density": round(out["density"], 4),
                "sparse_sent_mib": round(out["sent"]["sparse"] / 2**20, 1),
                "bitwise_exact": out["exact"],
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
