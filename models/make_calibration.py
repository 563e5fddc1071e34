"""Seeded calibration data for `tinydeploy quantize`: N samples per model input, written as one
.npz with a leading sample axis. Without a dataset at hand the samples are synthetic (standard
normal, or uniform 0..255 with --image-range); with real data, write the same .npz from it.

    python models/make_calibration.py MODEL.onnx -o calib.npz [-n 32] [--seed 0] [--image-range]
"""
import argparse

import numpy as np
import onnx


def make(model_path: str, n: int = 32, seed: int = 0, image_range: bool = False) -> dict:
    m = onnx.load(model_path, load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    rng = np.random.default_rng(seed)
    out = {}
    for inp in m.graph.input:
        if inp.name in inits:
            continue
        shape = [d.dim_value if d.dim_value > 0 else 1 for d in inp.type.tensor_type.shape.dim]
        x = rng.uniform(0, 255, (n, *shape)) if image_range else rng.standard_normal((n, *shape))
        out[inp.name] = x.astype(np.float32)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image-range", action="store_true")
    a = ap.parse_args()
    np.savez(a.output, **make(a.model, a.n, a.seed, a.image_range))
    print(f"wrote {a.output}: {a.n} samples")


if __name__ == "__main__":
    main()
