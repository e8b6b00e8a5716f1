"""BlockHasher and encode_workload: the semantics of docs/semantics.md, "Blocks and keys"; unsafe variants,
stability, encoding."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvlab.errors import ConfigError
from kvlab.hashing import SCHEMES, STABLE_SCHEMES, BlockHasher, EncodedWorkload, encode_workload
from kvlab.workload import from_lists

BS = 4


def toks(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def blocks(*ids: int) -> np.ndarray:
    """One BS-token block per id: [id*100, id*100+1, ...]."""
    return np.concatenate([np.arange(i * 100, i * 100 + BS) for i in ids]).astype(np.int64)


# ---------------------------------------------------------------------- reference encoding (docs/hashing.md)
def ref_field(tag: int, text: str) -> bytes:
    data = text.encode()
    return bytes([tag]) + len(data).to_bytes(4, "little") + data


def ref_hash(scheme: str, parent: int, msg: bytes) -> int:
    if scheme == "sha256":
        return int.from_bytes(hashlib.sha256(parent.to_bytes(32, "big") + msg).digest(), "big")
    if scheme == "xxh3_128":
        return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "big") + msg)
    return xxhash.xxh3_64_intdigest(msg, seed=parent)


def ref_keys(scheme, values, per_block, *, seed=0, model="kvlab", adapter=None, salt=None, mm=()):
    """Independent re-implementation of the documented byte encoding (chained, untruncated)."""
    m = model.encode()
    root_msg = (
        b"kvlab/block-key/v1\x00" + seed.to_bytes(8, "little") + b"\x01" + len(m).to_bytes(4, "little") + m
    )
    parent = ref_hash(scheme, 0, root_msg)
    keys = []
    for j in range(len(values) // per_block):
        msg = np.asarray(values[j * per_block : (j + 1) * per_block], dtype="<i8").tobytes()
        if adapter is not None:
            msg += ref_field(1, adapter)
        for mm_hash, start, length in sorted(mm, key=lambda t: t[1]):
            b0 = j * per_block
            if start < b0 + per_block and start + length > b0:
                msg += ref_field(2, mm_hash) + (b0 - start).to_bytes(8, "little", signed=True)
        if j == 0 and salt is not None:
            msg += ref_field(3, salt)
        parent = ref_hash(scheme, parent, msg)
        keys.append(parent)
    return keys


@pytest.mark.parametrize("scheme", STABLE_SCHEMES)
def test_keys_follow_documented_encoding(scheme):
    rng = np.random.default_rng(1)
    t = rng.integers(0, 200_000, size=50)
    h = BlockHasher(scheme, root_seed=7, model_id="llama-3-8b")
    assert h.token_keys(t, 8) == ref_keys(scheme, t, 8, seed=7, model="llama-3-8b")
    mm = [("img-b", 30, 5), ("img-a", 3, 10)]
    got = h.token_keys(t, 8, adapter="lora-1", salt="s", mm=mm)
    assert got == ref_keys(scheme, t, 8, seed=7, model="llama-3-8b", adapter="lora-1", salt="s", mm=mm)


# tokens 0..31, block size 16: (root, keys, keys with adapter "lora-7", salt "tenant-a", mm ("img0", 10, 12))
GOLDEN = {
    "sha256": (
        84338900907444834765156210666027870706229184305787113232265499369953376233986,
        [
            51341380463300363593297784379313914195114881302398621659229223210723727980151,
            96759256866817945127247311558350943849647489768407541869655960609855783940250,
        ],
        [
            91097773930210150221873530040993472876428673135019041085660702771841541508577,
            107450428590888549050539488371970425949308572973365738316593193985529286525601,
        ],
    ),
    "xxh3_128": (
        24947149866711474124394022917459574902,
        [122413355100556405872513773486113736864, 34744760269560788442446831583510460289],
        [153049371117029595482613084923991811185, 22107003158765537607503498588483790509],
    ),
    "xxh3_64": (
        12495901321462262085,
        [9254664904096228765, 16574803333653578206],
        [5904682277985629469, 7734086930202506550],
    ),
}


@pytest.mark.parametrize("scheme", STABLE_SCHEMES)
def test_golden_values(scheme):
    root, plain, extras = GOLDEN[scheme]
    h = BlockHasher(scheme)
    t = np.arange(32)
    assert h.root == root
    assert h.token_keys(t, 16) == plain
    assert h.token_keys(t, 16, adapter="lora-7", salt="tenant-a", mm=[("img0", 10, 12)]) == extras


_SUBPROCESS = """
import json, numpy as np
from kvlab.hashing import SCHEMES, BlockHasher
t = np.arange(1000, 1100)
def keys(s):
    return [str(k) for k in BlockHasher(s, root_seed=3).token_keys(t, 16, adapter="a", salt="b")]
out = {s: keys(s) for s in SCHEMES}
out["ids"] = [str(k) for k in BlockHasher("xxh3_64").id_keys(t, 25, group=4)]
print(json.dumps(out))
"""


def test_keys_identical_across_processes_except_builtin():
    runs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, env=env, check=True
        )
        runs.append(json.loads(res.stdout))
    t = np.arange(1000, 1100)
    for s in STABLE_SCHEMES:
        here = [str(k) for k in BlockHasher(s, root_seed=3).token_keys(t, 16, adapter="a", salt="b")]
        assert runs[0][s] == runs[1][s] == here
    assert (
        runs[0]["ids"] == runs[1]["ids"] == [str(k) for k in BlockHasher("xxh3_64").id_keys(t, 25, group=4)]
    )
    assert runs[0]["builtin"] != runs[1]["builtin"]  # in-process studies only
    assert not BlockHasher("builtin").stable and BlockHasher("xxh3_64").stable


# ---------------------------------------------------------------------- semantics
@pytest.mark.parametrize("scheme", SCHEMES)
def test_chaining_and_position_independence(scheme):
    h = BlockHasher(scheme)
    a = h.token_keys(blocks(1, 2, 3), BS)
    b = h.token_keys(blocks(9, 2, 3), BS)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # same blocks 2, 3 after another prefix
    assert h.token_keys(blocks(1, 2, 7), BS)[:2] == a[:2]  # shared prefix, shared keys
    u = BlockHasher(scheme, chained=False)
    ua, ub = u.token_keys(blocks(1, 2, 3), BS), u.token_keys(blocks(9, 2, 3), BS)
    assert ua[1:] == ub[1:] and ua[0] != ub[0]
    assert u.token_keys(blocks(3, 2), BS) == [ua[2], ua[1]]  # position-independent
    assert all(0 <= k < 1 << h.key_bits for k in a)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_root_seed_and_model_change_every_key(scheme):
    t = blocks(1, 2, 3, 4)
    base = BlockHasher(scheme).token_keys(t, BS)
    for other in (BlockHasher(scheme, root_seed=1), BlockHasher(scheme, model_id="other-model")):
        assert not set(other.token_keys(t, BS)) & set(base)
    loose = BlockHasher(scheme, include_model=False)
    assert loose.token_keys(t, BS) == BlockHasher(scheme, include_model=False, model_id="x").token_keys(t, BS)
    assert not set(loose.token_keys(t, BS)) & set(base)
    assert BlockHasher(scheme, root_seed=5).root != BlockHasher(scheme).root


def test_adapter_on_every_block():
    t = blocks(1, 2, 3)
    u = BlockHasher("xxh3_64", chained=False)  # unchained isolates each block's own extras
    plain, lora = u.token_keys(t, BS), u.token_keys(t, BS, adapter="lora-1")
    assert all(p != q for p, q in zip(plain, lora, strict=True))
    assert u.token_keys(t, BS, adapter="lora-2") != lora
    h = BlockHasher("xxh3_64")
    assert (
        h.token_keys(t, BS, adapter=float("nan")) == h.token_keys(t, BS) == h.token_keys(t, BS, adapter=None)
    )
    no_adapter = BlockHasher("xxh3_64", include_adapter=False)
    assert no_adapter.token_keys(t, BS, adapter="lora-1") == no_adapter.token_keys(t, BS)


def test_salt_on_first_block_only():
    t = blocks(1, 2, 3)
    h = BlockHasher("xxh3_128")
    plain, salted = h.token_keys(t, BS), h.token_keys(t, BS, salt="tenant-a")
    assert not set(plain) & set(salted)  # chained: a salted request shares nothing with an unsalted one
    assert h.token_keys(blocks(1, 2, 9), BS, salt="tenant-a")[:2] == salted[:2]  # same salt shares
    assert not set(h.token_keys(t, BS, salt="tenant-b")) & set(salted)
    u = BlockHasher("xxh3_128", chained=False)
    up, us = u.token_keys(t, BS), u.token_keys(t, BS, salt="tenant-a")
    assert up[0] != us[0] and up[1:] == us[1:]  # only block 0 carries the salt
    assert BlockHasher("xxh3_128", include_salt=False).token_keys(t, BS, salt="x") == BlockHasher(
        "xxh3_128", include_salt=False
    ).token_keys(t, BS)


def test_mm_extras_only_on_overlapping_blocks():
    t = blocks(1, 2, 3, 4, 5)
    u = BlockHasher("xxh3_64", chained=False)
    plain = u.token_keys(t, BS)
    img = u.token_keys(t, BS, mm=[("img", 5, 6)])  # tokens 5..10: blocks 1 and 2
    assert [p == q for p, q in zip(plain, img, strict=True)] == [True, False, False, True, True]
    other = u.token_keys(t, BS, mm=[("img2", 5, 6)])
    assert other[1] != img[1] and other[2] != img[2]
    h = BlockHasher("xxh3_64")
    chained = h.token_keys(t, BS, mm=[("img", 5, 6)])
    base = h.token_keys(t, BS)
    assert chained[0] == base[0] and not set(chained[1:]) & set(base)
    assert h.token_keys(t[:18], BS, mm=[("img", 16, 50)]) == base[:4]  # only in the unkeyed partial tail


def test_partial_block_not_keyed():
    h = BlockHasher()
    t = np.arange(2 * BS + 3)
    keys = h.token_keys(t, BS)
    assert len(keys) == 2 and keys == h.token_keys(t[: 2 * BS], BS)
    assert h.token_keys(t[: BS - 1], BS) == []
    assert len(h.id_keys(np.arange(5), 3)) == 3


def test_truncation_forces_and_propagates_collisions():
    h = BlockHasher("xxh3_64", truncate_bits=4)
    assert h.unsafe and h.label == "xxh3_64/trunc4/unsafe" and h.key_bits == 4
    firsts = [h.token_keys(blocks(i), BS)[0] for i in range(40)]
    assert all(0 <= k < 16 for k in firsts)
    by_key: dict[int, int] = {}
    pair = next((by_key[k], i) for i, k in enumerate(firsts) if by_key.setdefault(k, i) != i)
    a, b = h.token_keys(blocks(pair[0], 7, 8), BS), h.token_keys(blocks(pair[1], 7, 8), BS)
    assert a == b  # different first blocks collide, and the collision carries down the chain
    full = BlockHasher("xxh3_64")
    assert full.token_keys(blocks(pair[0], 7, 8), BS) != full.token_keys(blocks(pair[1], 7, 8), BS)
    wide = BlockHasher("sha256", truncate_bits=8)
    assert all(k < 256 for k in wide.token_keys(blocks(1, 2, 3), BS))


def test_labels():
    assert BlockHasher().label == "xxh3_128" and not BlockHasher().unsafe
    assert BlockHasher("xxh3_64", chained=False).label == "xxh3_64/unchained/unsafe"
    h = BlockHasher("sha256", include_model=False, include_adapter=False, include_salt=False)
    assert h.label == "sha256/no-model/no-adapter/no-salt/unsafe"
    assert BlockHasher("builtin").label == "builtin"
    assert BlockHasher("xxh3_64", truncate_bits=20).config()["key_bits"] == 20


def test_group_reblocking_equals_hashing_concatenated_ids():
    ids = np.array([5, 17, 3, 99, 42, 8, 1, 2, 77], dtype=np.int64)
    h = BlockHasher("xxh3_64")
    g = h.id_keys(ids, 2, group=4)
    assert g == ref_keys("xxh3_64", ids[:8], 4)
    assert g == h.token_keys(ids, 4)
    assert h.id_keys(ids, 4, group=2) == h.token_keys(ids[:8], 2)
    assert h.id_keys(ids, 9) != h.id_keys(ids, 9, salt="s")


# ---------------------------------------------------------------------- encode_workload
def test_encode_token_workload_dense_ids():
    prompts = [blocks(1, 2, 3), np.concatenate([blocks(1, 2, 4), [7, 7]]), blocks(5), np.arange(3)]
    wl = from_lists(
        prompts, kind="tokens", adapter=[None, None, "lora", None], salt=[None, np.nan, None, "s"]
    )
    h = BlockHasher("xxh3_64")
    enc = encode_workload(wl, h, BS)
    assert isinstance(enc, EncodedWorkload) and len(enc) == 4
    assert enc.offsets.tolist() == [0, 3, 6, 7, 7]
    assert enc.key_ids.tolist() == [0, 1, 2, 0, 1, 3, 4]
    assert enc.num_keys == 5 and enc.block_size == BS and enc.hash_label == "xxh3_64"
    assert enc.prompt_tokens.tolist() == [12, 14, 4, 3] and enc.num_blocks.tolist() == [3, 4, 1, 1]
    assert enc.full_blocks.tolist() == [3, 3, 1, 0] and enc.truth_ids is None
    all_keys = []  # equal ids <=> equal keys, ids in order of first appearance
    for i, p in enumerate(prompts):
        adapter = "lora" if i == 2 else None
        all_keys += h.token_keys(p, BS, adapter=adapter, salt="s" if i == 3 else None)
    first = list(dict.fromkeys(all_keys))
    assert enc.key_ids.tolist() == [first.index(k) for k in all_keys]
    for d in (enc.offsets, enc.key_ids, enc.prompt_tokens, enc.num_blocks):
        assert d.dtype == np.int64


def test_encode_salt_and_adapter_columns():
    p = blocks(1, 2)
    wl = from_lists([p, p, p, p], kind="tokens", salt=["a", "a", None, "b"])
    ids = encode_workload(wl, BlockHasher(), BS).key_ids.tolist()
    assert ids == [0, 1, 0, 1, 2, 3, 4, 5]
    wl = from_lists([p, p], kind="tokens", adapter=["x", "y"])
    loose = encode_workload(wl, BlockHasher(include_adapter=False), BS)
    assert loose.key_ids.tolist() == [0, 1, 0, 1] and loose.hash_label.endswith("unsafe")


def test_encode_verify_counts_collisions():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, size=int(rng.integers(8, 40))) for _ in range(60)]
    wl = from_lists(prompts, kind="tokens")
    enc = encode_workload(wl, BlockHasher("xxh3_64", truncate_bits=4), BS, verify=True)
    assert enc.num_keys <= 16 and enc.num_truth > enc.num_keys
    assert len(enc.truth_ids) == len(enc.key_ids)
    i, j = np.nonzero(
        (enc.key_ids[:, None] == enc.key_ids[None, :]) & (enc.truth_ids[:, None] != enc.truth_ids[None, :])
    )
    assert len(i) > 0 and enc.colliding_keys() > 0
    exact = encode_workload(wl, BlockHasher("xxh3_64"), BS, verify=True)
    assert exact.colliding_keys() == 0 and np.array_equal(exact.key_ids, exact.truth_ids)
    assert np.array_equal(exact.truth_ids, enc.truth_ids)  # truth ignores the hasher's unsafe settings
    ref = encode_workload(wl, BlockHasher("sha256"), BS, verify=True)
    assert np.array_equal(ref.key_ids, ref.truth_ids)
    with pytest.raises(ConfigError):
        encode_workload(wl, BlockHasher(), BS).colliding_keys()


def test_encode_block_trace_and_group():
    ids = [[0, 1, 2, 3, 4], [0, 1, 2, 9], [0, 5]]
    wl = from_lists(ids, kind="blocks", block_size=16, input_length=[80, 60, 20])
    h = BlockHasher("xxh3_128")
    enc = encode_workload(wl, h)
    assert enc.block_size == 16 and enc.offsets.tolist() == [0, 5, 8, 9]
    assert enc.key_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0]
    assert enc.num_blocks.tolist() == [5, 4, 2]
    coarse = encode_workload(wl, h, 32, verify=True)
    assert coarse.offsets.tolist() == [0, 2, 3, 3] and coarse.num_blocks.tolist() == [3, 2, 1]
    assert coarse.key_ids.tolist() == [0, 1, 0]
    keys = h.id_keys(np.array(ids[0]), 2, group=2)
    assert keys == h.token_keys(np.array([0, 1, 2, 3]), 2)
    trunc = encode_workload(wl, BlockHasher("xxh3_64", truncate_bits=1), verify=True)
    assert trunc.num_keys <= 2 and trunc.num_truth == 5


def test_encode_errors_and_progress():
    tw = from_lists([np.arange(10)], kind="tokens")
    with pytest.raises(ConfigError, match="required"):
        encode_workload(tw, BlockHasher())
    for bad in (0, -4, 2.5):
        with pytest.raises(ConfigError):
            encode_workload(tw, BlockHasher(), bad)
    bw = from_lists([[1, 2]], kind="blocks", block_size=16)
    for bad in (8, 24):
        with pytest.raises(ConfigError, match=r"kvlab\.workload\.expand.*coarser sizes are faithful"):
            encode_workload(bw, BlockHasher(), bad)
    assert encode_workload(tw, BlockHasher(), 4, progress=True).key_ids.tolist() == [0, 1]
    empty = encode_workload(from_lists([], kind="tokens"), BlockHasher(), 4)
    assert empty.num_keys == 0 and empty.offsets.tolist() == [0]


def test_hasher_errors():
    with pytest.raises(ConfigError, match="scheme"):
        BlockHasher("md5")
    for bits in (0, 64, True):
        with pytest.raises(ConfigError, match="truncate_bits"):
            BlockHasher("xxh3_64", truncate_bits=bits)
    with pytest.raises(ConfigError, match="root_seed"):
        BlockHasher(root_seed=-1)
    h = BlockHasher()
    with pytest.raises(ConfigError):
        h.token_keys(np.arange(8), 0)
    with pytest.raises(ConfigError):
        h.token_keys(np.arange(8.0), 4)
    with pytest.raises(ConfigError, match="mm"):
        h.token_keys(np.arange(8), 4, mm=[("img", 0)])
    with pytest.raises(ConfigError, match="mm"):
        h.token_keys(np.arange(8), 4, mm=[("img", 0, 0)])
    with pytest.raises(ConfigError, match="n_full"):
        h.id_keys(np.arange(5), 3, group=2)
    with pytest.raises(ConfigError, match="group"):
        h.id_keys(np.arange(5), 1, group=0)
