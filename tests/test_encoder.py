import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import tqindex as tq

NAMES = tq.encoder_names()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dim", [64, 50])
def test_every_encoder_contract(name, dim):
    enc = tq.make_encoder(name, dim)
    enc.train(torch.randn(300, dim) * torch.linspace(2, 0.1, dim))  # learned encoders only
    x = torch.randn(3, 7, dim)
    codes = enc.encode(x)
    assert codes.shape == (3, 7)
    assert codes.nbytes == 21 * enc.code_size  # code_size is exact, side data included
    x_hat = enc.decode(codes)
    assert x_hat.shape == x.shape and x_hat.dtype == torch.float32
    q = torch.randn(5, dim)
    flat = codes.reshape(21)
    s = enc.score(q, flat)
    assert s.shape == (5, 21) and s.dtype == torch.float32
    torch.testing.assert_close(s, q @ enc.decode(flat).T, rtol=1e-4, atol=1e-4)
    # batched score over leading dims: q [3, m, d] against codes [3, n]
    torch.testing.assert_close(enc.score(q.expand(3, 5, dim), codes), q @ x_hat.mT, rtol=1e-4, atol=1e-4)
    # configuration round trip through JSON, with and without the stored tensors
    config = json.loads(json.dumps(enc.to_dict()))
    bare = tq.encoder_from_dict(config)  # a learned encoder needs its stored tensors
    for other in (bare, tq.encoder_from_dict(config, enc.tensors())) if bare.is_trained else (tq.encoder_from_dict(config, enc.tensors()),):
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(other.encode(x).planes(), codes.planes()))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_and_half_inputs(dtype):
    enc = tq.make_encoder("tq4", 32)
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(dtype)
    ref = enc.encode(torch.from_numpy(x.astype(np.float32)))
    assert torch.equal(enc.encode(x).qdata, ref.qdata)
    assert enc.encode(torch.from_numpy(x).to(torch.bfloat16)).shape == (4,)


def test_same_seed_same_codes_in_a_new_process():
    code = (
        "import hashlib, torch, tqindex as tq\n"
        "x = torch.linspace(-3, 3, 50 * 8).reshape(8, 50).sin()\n"
        "out = []\n"
        "for n in tq.encoder_names():\n"
        "    e = tq.make_encoder(n, 50, seed=5)\n"
        "    e.train(x)\n"
        "    c = e.encode(x)\n"
        "    out.append(hashlib.sha256(b''.join(t.numpy().tobytes() for _, t in c.planes())).hexdigest())\n"
        "print(' '.join(out))\n"
    )
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout  # noqa: E731
    first = run()
    assert first == run() and len(first.split()) == len(NAMES)
    x = torch.linspace(-3, 3, 50 * 8).reshape(8, 50).sin()
    a = tq.make_encoder("tq4", 50, seed=5).encode(x).qdata
    b = tq.make_encoder("tq4", 50, seed=6).encode(x).qdata
    assert not torch.equal(a, b)


@pytest.mark.parametrize("name", ["tq4", "tq3-prod", "fp4"])
def test_bad_input_names_the_problem(name):
    enc = tq.make_encoder(name, 64)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        enc.encode(torch.randn(3, 60))
    with pytest.raises(ValueError, match="NaN"):
        enc.encode(torch.tensor([[float("nan")] * 64]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        enc.encode(np.full((2, 64), np.inf, dtype=np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        enc.encode(np.full((2, 64), np.nan, dtype=np.float16))
    with pytest.raises(ValueError, match="NaN or infinite"):  # finite in float64, not in float32
        enc.encode(np.full((2, 64), 1e300))
    with pytest.raises(TypeError, match="dtype"):
        enc.encode(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="floating"):
        enc.encode(np.ones((2, 64), dtype=np.int64))
    with pytest.raises(TypeError, match="numpy array or torch tensor"):
        enc.encode([[0.0] * 64])
    with pytest.raises(ValueError, match="empty"):
        enc.encode(torch.empty(0, 64))
    with pytest.raises(ValueError, match="q must have shape"):
        enc.score(torch.randn(2, 63), enc.encode(torch.randn(2, 64)))


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown encoder name 'tq9'"):
        tq.make_encoder("tq9", 64)
    with pytest.raises(ValueError, match="unknown encoder type"):
        tq.encoder_from_dict({"type": "Pickle"})
    with pytest.raises(ValueError, match="unknown TurboQuantMSE fields"):
        tq.encoder_from_dict({"type": "TurboQuantMSE", "dim": 8, "evil": 1})
    enc = tq.make_encoder("tq4", 64)
    with pytest.raises(ValueError, match="encoder tensor"):
        enc.load_tensors({k: v[:1] for k, v in enc.tensors().items()})


def test_registry_names():
    assert {"tq1", "tq2", "tq3", "tq4", "tq8", "tq3-prod", "tq4-norm", "fp4"} <= set(NAMES)
    assert tq.make_encoder("tq3", 64, seed=2).seed == 2
