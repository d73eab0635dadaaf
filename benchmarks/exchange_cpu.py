"""The CPU an averaging exchange spends on the weights themselves, beside what the wire takes.

For --floats random float32 values (default: SmolLM2-135M-Instruct's 134,515,008 parameters, split as its
tensors are: the 49,152 x 576 embedding, 30 layers' projections and norms), per transfer mode: CPU
seconds (this process, --threads torch threads) to encode the weights, frame them as bytes, read the
bytes back, decode them, and check a partner's weights (node/weights/validation.py: names, shapes,
finiteness, relative distance). The check is timed beside the one it replaced (a float64 copy of every
tensor, and a finite pass of its own before the distance), on the same tensors in the same run.
Least of --repeats each. Ends with one JSON line.

    .venv/bin/python benchmarks/exchange_cpu.py --results benchmarks/results/exchange_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import print_result_line  # noqa: E402
from node.weights.codec import EncodedWeights, decode_weights, encode_weights  # noqa: E402
from node.weights.validation import validate_partner_weights  # noqa: E402

SMOLLM2_PARAMETERS = 134_515_008


def smollm2_shaped(floats: int) -> dict[str, torch.Tensor]:
    """Random tensors shaped like SmolLM2's (576 wide, 1,536 MLP, 3 KV heads of 64, 30 layers, tied embedding),
    scaled to `floats` values in all by the number of layers kept."""
    per_layer = {
        "q": (576, 576), "k": (192, 576), "v": (192, 576), "o": (576, 576),
        "gate": (1536, 576), "up": (1536, 576), "down": (576, 1536), "norm1": (576,), "norm2": (576,),
    }  # fmt: skip
    layer_floats = sum(math.prod(shape) for shape in per_layer.values())
    embedding = 49_152 * 576
    layers = max(1, round((floats - embedding - 576) / layer_floats))
    torch.manual_seed(0)
    named = {"embed": torch.randn(49_152, 576) * 0.02, "norm": torch.ones(576)}
    for i in range(layers):
        for name, shape in per_layer.items():
            named[f"layers.{i}.{name}"] = torch.randn(*shape) * 0.02
    return named


def replaced_check(local: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> float:
    """The partner check before 2026-12-02: a finite pass over every tensor, then the distance from float64 copies."""
    for theirs in received.values():
        if not bool(torch.isfinite(theirs).all()):
            raise ValueError("not finite")
    diff_sq = local_sq = 0.0
    for name, mine in local.items():
        mine64 = mine.to(torch.float64)
        diff_sq += float((received[name].to(torch.float64) - mine64).square().sum())
        local_sq += float(mine64.square().sum())
    return math.sqrt(diff_sq) / (math.sqrt(local_sq) + 1e-12)


def least_cpu_s(work, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--floats", type=int, default=SMOLLM2_PARAMETERS)
    parser.add_argument("--modes", nargs="+", default=["fp32", "fp16", "int4"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    local = smollm2_shaped(args.floats)
    values = sum(t.numel() for t in local.values())
    partner = {name: t + 0.001 * torch.randn_like(t) for name, t in local.items()}
    modes = {}
    for mode in args.modes:
        encoded = encode_weights(partner, mode)
        raw = encoded.to_bytes()
        decoded = decode_weights(EncodedWeights.from_bytes(raw))
        modes[mode] = {
            "bytes": len(raw),
            "encode_cpu_s": least_cpu_s(lambda: encode_weights(partner, mode), args.repeats),
            "to_bytes_cpu_s": least_cpu_s(encoded.to_bytes, args.repeats),
            "from_bytes_cpu_s": least_cpu_s(lambda: EncodedWeights.from_bytes(raw), args.repeats),
            "decode_cpu_s": least_cpu_s(lambda: decode_weights(EncodedWeights.from_bytes(raw)), args.repeats),
        }
        print(f"{mode}: {json.dumps(modes[mode])}", flush=True)
    check = least_cpu_s(lambda: validate_partner_weights(local, decoded, 10.0), args.repeats)
    replaced = least_cpu_s(lambda: replaced_check(local, decoded), args.repeats)
    print(f"partner check: {check:.2f} CPU s, the one it replaced {replaced:.2f} ({replaced / check:.2f}x)")
    line = {
        "benchmark": "exchange_cpu",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "values": values,
        "tensors": len(local),
        "threads": args.threads,
        "modes": modes,
        "check_cpu_s": check,
        "replaced_check_cpu_s": replaced,
        "check_speedup": replaced / check,
        "load_average": os.getloadavg(),
    }
    print_result_line(line, args.results)


if __name__ == "__main__":
    main()
