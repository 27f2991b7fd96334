"""Node identity, replica placement, and copies sent between real gloo ranks, verified on arrival."""

from __future__ import annotations

import functools
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import zerostall as zs
from distributed import RankError, RankPool
from faults import wait_for
from zerostall.format.layout import MANIFEST_NAME
from zerostall.tiers import nodes as nodes_module
from zerostall.tiers.nodes import NODE_ENV, Nodes, node_id
from zerostall.tiers.transfer import INCOMING

# -- nodes, pure ---------------------------------------------------------------------------------


def test_node_id_from_the_environment_else_hostname_and_boot_id(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    monkeypatch.setenv(NODE_ENV, "  spare-7 \n")
    assert node_id() == "spare-7"
    monkeypatch.setenv(NODE_ENV, "   ")  # blank: as if unset
    boot = tmp_path / "boot_id"
    boot.write_text("0123456789abcdef\n")
    monkeypatch.setattr(nodes_module, "BOOT_ID", str(boot))
    monkeypatch.setattr(nodes_module.socket, "gethostname", lambda: "host-a")
    assert node_id() == "host-a-01234567"
    monkeypatch.setattr(nodes_module, "BOOT_ID", str(tmp_path / "absent"))
    assert node_id() == "host-a"


def test_nodes_are_ordered_by_their_smallest_rank() -> None:
    nodes = Nodes(("b", "a", "b", "c", "a", "c"))
    assert nodes.count == 3
    assert [nodes.ranks_on(i) for i in range(3)] == [[0, 2], [1, 4], [3, 5]]
    assert [nodes.index(r) for r in range(6)] == [0, 1, 0, 2, 1, 2]


def test_holders_form_a_ring_over_other_nodes() -> None:
    nodes = Nodes(("a", "a", "b", "b", "c", "c"))
    assert nodes.holders(0, 2) == [2] and nodes.holders(1, 2) == [3] and nodes.holders(4, 2) == [0]
    assert nodes.holders(1, 3) == [3, 5]
    assert nodes.holders(1, 9) == [3, 5]  # at most one replica on each other node
    assert nodes.holders(3, 1) == []
    for replicas in (1, 2, 3):
        for rank in range(6):
            held = nodes.holders(rank, replicas)
            on = [nodes.index(h) for h in held]
            assert nodes.index(rank) not in on and len(set(on)) == len(on) == min(replicas, 3) - 1
            assert sorted(nodes.sources(rank, replicas)) == [r for r in range(6) if rank in nodes.holders(r, replicas)]
    assert nodes.sources(0, 2) == [4] and nodes.sources(3, 3) == [1, 5]


def test_holders_on_nodes_of_unequal_sizes_and_on_one_node() -> None:
    nodes = Nodes(("a", "a", "a", "b"))
    assert [nodes.holders(r, 2) for r in range(4)] == [[3], [3], [3], [0]]
    assert nodes.sources(3, 2) == [0, 1, 2]
    alone = Nodes(("a", "a"))
    assert alone.count == 1 and alone.holders(0, 3) == [] and alone.sources(1, 3) == []


def test_a_spare_node_keeps_the_placement() -> None:
    """A lost node replaced by a spare under another id: the same ranks, so the same holders."""
    before = Nodes(("n0", "n0", "n1", "n1", "n2", "n2"))
    after = Nodes(("n0", "n0", "spare", "spare", "n2", "n2"))
    assert all(before.holders(r, 3) == after.holders(r, 3) for r in range(6))


def test_the_manifest_travels_alone_then_the_files_a_wave_at_a_time_in_turn() -> None:
    from zerostall.tiers.stream import Plan

    plan = Plan([("manifest.json", 5), ("a", 7), ("b", 3), ("c", 0), ("d", 4)], chunk=3, wave=2,
                cuts=[[], [], [], [], []])
    assert [(group, list(chunks)) for group, chunks in plan.waves()] == [
        ([0], [(0, 0, 3), (0, 3, 2)]),
        ([1, 2], [(1, 0, 3), (2, 0, 3), (1, 3, 3), (1, 6, 1)]),
        ([3, 4], [(4, 0, 3), (4, 3, 1)])]


def test_no_chunk_crosses_a_cut() -> None:
    """A file is cut at the bounds of tensors a receiver may put into memory: a chunk ends at each cut."""
    from zerostall.tiers.stream import Plan

    plan = Plan([("manifest.json", 2), ("a", 10)], chunk=4, wave=1, cuts=[[], [2, 3, 9]])
    assert [list(chunks) for _, chunks in plan.waves()][1] == [(1, 0, 2), (1, 2, 1), (1, 3, 4), (1, 7, 2), (1, 9, 1)]
    assert plan.edges() == {(0, 0), (0, 2), (1, 0), (1, 2), (1, 3), (1, 9), (1, 10)}


def _manifest(folder: Path):
    from zerostall.loading.opening import read_manifest
    from zerostall.storage.local import LocalStorage

    return read_manifest(LocalStorage(str(folder), fsync=False))


def test_a_file_checked_as_it_arrives_in_pieces_of_any_size(tmp_path: Path) -> None:
    """Pieces that straddle blocks, chunks and the header, empty ones, one piece for the whole file:
    the same bytes pass; one flipped byte fails, naming its entry and block; a file that stops
    short is not passed."""
    import random

    from zerostall.errors import CheckpointError, CorruptCheckpointError
    from zerostall.loading.reader import ChunkReader
    from zerostall.loading.verification import arriving_files
    from zerostall.storage.local import LocalStorage

    zs.save(_state(1), str(tmp_path / "ckpt"), block_size=1000)
    manifest = _manifest(tmp_path / "ckpt")
    reader = ChunkReader(LocalStorage(str(tmp_path / "ckpt"), fsync=False), manifest, 1)
    rng = random.Random(0)

    def feed(name: str, data: bytes) -> None:
        """``data`` arrives as data file ``name`` (its size: the manifest's) in pieces of random sizes."""
        arriving, at = arriving_files(reader, {name: manifest.files[name]})[name], 0
        while at < len(data):
            n = rng.choice([0, 1, 7, 999, 1000, 1001, 4096, len(data)])
            arriving.update(memoryview(data)[at:at + n])
            at += n
        arriving.finish()

    for name in manifest.files:
        data = (tmp_path / "ckpt" / name).read_bytes()
        for _ in range(3):
            feed(name, data)
    name = max(manifest.files, key=manifest.files.get)
    data = bytearray((tmp_path / "ckpt" / name).read_bytes())
    with pytest.raises(CheckpointError, match="only 5000 of its"):
        feed(name, bytes(data[:5000]))
    chunk = max((c for e in manifest.entries if e.kind == "tensor" for c in e.chunks if c.file == name),
                key=lambda c: c.nbytes)
    data[chunk.offset + 2500] ^= 0x40
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch in {name} .*block 2 "):
        feed(name, bytes(data))


# -- over real ranks -----------------------------------------------------------------------------


def _gather(ids: list[str]) -> tuple[tuple[str, ...], list[list[int]]]:
    import torch.distributed as dist

    from zerostall.collectives import Group
    from zerostall.tiers.nodes import gather_nodes

    os.environ[NODE_ENV] = ids[dist.get_rank()]
    try:
        nodes = gather_nodes(Group())
    finally:
        del os.environ[NODE_ENV]
    return nodes.ids, [nodes.ranks_on(i) for i in range(nodes.count)]


def test_gather_nodes_over_four_ranks(ranks) -> None:
    results = ranks(4).run(_gather, ["y", "x", "y", "x"])
    assert results == [(("y", "x", "y", "x"), [[0, 2], [1, 3]])] * 4


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "steps": torch.randint(0, 1 << 40, (33,), generator=g), "epoch": seed, "name": f"rank {seed}",
            **{f"layer{i}": torch.randn(5000 * i + 1, generator=g) for i in range(5)}}


def _empty_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _assert_same(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].view(torch.uint8),
                                                                   value.view(torch.uint8)), key
        else:
            assert loaded[key] == value, key


def _copies(tmp_path: Path, world: int) -> list[Path]:
    """One committed one-rank checkpoint per rank, saved here (no process group), in 6 data files
    (so they travel in two waves, the files of each in turn)."""
    out = []
    for rank in range(world):
        path = tmp_path / f"own_{rank}"
        zs.save(_state(rank), str(path), threads=6)
        out.append(path)
    return out


def _exchange(sends: list, receives: list, chunk_bytes: int, pg_timeout: float | None = None,
              cut: bool = False) -> list:
    """Run exchange on this rank; returns the published paths, or the error's type and message."""
    import torch.distributed as dist

    from zerostall.tiers.transfer import exchange

    pg = dist.group.WORLD
    if pg_timeout is not None:
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=pg_timeout))
    try:
        got = exchange(pg, sends, receives, chunk_bytes=chunk_bytes, cut=cut)
        return [None if p is None else str(p.folder) for p in got]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


@pytest.mark.parametrize("ids,replicas", [(["a", "a", "b", "b"], 2), (["a", "b", "c", "d"], 3)])
def test_exchange_sends_every_copy_to_its_holders_bit_exact(ranks, tmp_path: Path, ids: list[str],
                                                            replicas: int) -> None:
    """Every rank sends and receives at once (pairs in both directions, several peers), in chunks
    far smaller than the files; each received copy loads bit-exactly."""
    nodes = Nodes(tuple(ids))
    own = _copies(tmp_path, 4)
    node_dir = [tmp_path / f"node_{nodes.index(r)}" / "step_000000010" for r in range(4)]
    args = [([(h, own[r]) for h in nodes.holders(r, replicas)],
             [(s, node_dir[r] / f"rank_{s:05d}") for s in nodes.sources(r, replicas)], 4096) for r in range(4)]
    results = ranks(4).run_per_rank(_exchange, args)
    for r in range(4):
        assert results[r] == [str(p) for _, p in args[r][1]]
        for src, path in args[r][1]:
            assert sorted(os.listdir(path)) == sorted(os.listdir(own[src]))
            _assert_same(zs.load(_empty_like(_state(src)), str(path)), _state(src))
        assert not [p for p in os.listdir(node_dir[r]) if p.startswith(INCOMING)]


def test_nothing_to_send_and_a_copy_that_cannot_be_sent(ranks, tmp_path: Path) -> None:
    """None: the receiver learns there is nothing (None, nothing published); a copy without a
    manifest (never committed): the receiver raises it as damage, naming the sender, which goes on
    (a restore falls back to another copy, as from a damaged one of its own)."""
    own = _copies(tmp_path, 1)[0]
    uncommitted = tmp_path / "uncommitted"
    zs.save(_state(3), str(uncommitted))
    (uncommitted / MANIFEST_NAME).unlink()  # as a save that never committed leaves it
    dest = tmp_path / "held"
    args = [([(1, None), (2, own)], [(3, dest / "rank_00003")], 4096),
            ([], [(0, dest / "rank_00000")], 4096), ([], [(0, dest / "copy_of_0")], 4096),
            ([(0, uncommitted)], [], 4096)]
    results = ranks(4).run_per_rank(_exchange, args)
    assert results[1] == [None] and not (dest / "rank_00000").exists()
    assert results[2] == [str(dest / "copy_of_0")]
    kind, message = results[0]
    assert kind == "CorruptCheckpointError" and "rank 3 could not send its copy" in message and "no manifest" in message
    assert results[3] == []
    assert sorted(os.listdir(dest)) == ["copy_of_0"]


def _flip_byte(folder: Path) -> str:
    """Flip one byte in the middle of the largest data file; returns its name."""
    name = max((p for p in os.listdir(folder) if p != MANIFEST_NAME), key=lambda p: os.path.getsize(folder / p))
    with open(folder / name, "r+b") as f:
        f.seek(os.path.getsize(folder / name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return name


def test_a_flipped_byte_is_caught_and_nothing_is_published(ranks, tmp_path: Path) -> None:
    """The copy on the sender is damaged: the receiver's check finds it and keeps nothing; a good
    copy already held under that name stays."""
    own = _copies(tmp_path, 2)
    held = tmp_path / "node_1" / "rank_00000"
    zs.save(_state(7), str(held))  # an older copy in place
    name = _flip_byte(own[0])
    results = ranks(2).run_per_rank(_exchange, [([(1, own[0])], [], 1 << 16), ([], [(0, held)], 1 << 16)])
    assert results[0] == []
    kind, message = results[1]
    assert kind == "CorruptCheckpointError"
    assert "rank 0" in message and name in message and "checksum mismatch" in message and str(held) in message
    assert sorted(os.listdir(held.parent)) == ["rank_00000"]
    _assert_same(zs.load(_empty_like(_state(7)), str(held)), _state(7))


def _tied(state: dict) -> dict:
    """``state`` with a second key for its large tensor: the same tensor (tied weights)."""
    return {**state, "tied": state["w"]}


def _into_memory(own: str, held: str, cut: bool = True, tied: bool = False, copied: bool = False) -> Any:
    """Rank 1 sends its copy (``cut``: as a restore's sender does); rank 0 receives it into a
    zeroed state (``tied``: see :func:`_tied`) where it can, then loads the rest. ``copied``: every
    placed chunk goes through a buffer and is copied into the state, as for a GPU's memory."""
    import torch.distributed as dist

    from zerostall.options import LoadOptions
    from zerostall.tiers import transfer
    from zerostall.tiers.copies import load_copy, placements, view

    if dist.get_rank() == 1:
        return _exchange([(0, Path(own))], [], 1 << 16, cut=cut)
    state = _tied(_empty_like(_state(1))) if tied else _empty_like(_state(1))
    memory = {k: v.data_ptr() for k, v in state.items() if isinstance(v, torch.Tensor)}
    target = view(state, restoring=True)
    direct = transfer.direct
    transfer.direct = (lambda into: False) if copied else direct
    try:
        (landed,) = transfer.exchange(dist.group.WORLD, [], [(1, Path(held))], chunk_bytes=1 << 16,
                                      place=functools.partial(placements, target))
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    finally:
        transfer.direct = direct
    published = os.path.exists(held)
    placed = {k: torch.equal(state[k], _state(1)[k]) for k in landed.placed}  # before the rest is loaded
    loaded = load_copy(state, target, landed.folder, options=LoadOptions(verify=False), placed=landed.placed,
                       manifest=landed.manifest)
    return {"placed": placed, "published": published, "folder": str(landed.folder), "state": loaded,
            "in_place": all(state[k].data_ptr() == ptr for k, ptr in memory.items())}


def _layout_copy(tmp_path: Path, tied: bool = False) -> Path:
    """Rank 1's copy as the local tier saves it: with the digest of its layout."""
    from zerostall.tiers.copies import LAYOUT_KEY, view

    own = tmp_path / "own_1"
    state = _tied(_state(1)) if tied else _state(1)
    zs.save(state, str(own), threads=6, metadata={LAYOUT_KEY: view(state).digest})
    return own


@pytest.mark.parametrize("copied", [False, True], ids=["received", "copied"])
def test_a_restore_receives_large_tensors_straight_into_the_state(ranks, tmp_path: Path, copied: bool) -> None:
    """The tensors of at least PLACEABLE bytes arrive in the target's own memory (received there,
    or, as for a GPU, through a buffer and copied), right before anything is loaded; the rest loads
    from the folder, which is not published; bit-exact."""
    from zerostall.tiers.placing import PLACEABLE

    held = tmp_path / "node" / "rank_00001"
    got = ranks(2).run(_into_memory, str(_layout_copy(tmp_path)), str(held), True, False, copied)[0]
    large = sorted(k for k, v in _state(1).items() if isinstance(v, torch.Tensor) and v.nbytes >= PLACEABLE)
    assert large == ["w"] and sorted(got["placed"]) == large and all(got["placed"].values())
    assert not got["published"] and got["in_place"] and Path(got["folder"]).parent == held.parent
    _assert_same(got["state"], _state(1))


def test_a_tensor_another_entry_aliases_is_not_received_into_memory(ranks, tmp_path: Path) -> None:
    """Tied weights: the alias loads from the copy's bytes of the tensor it aliases, so that tensor
    must be in the folder, not in memory (loading the alias would copy the folder's hole over it)."""
    held = tmp_path / "node" / "rank_00001"
    got = ranks(2).run(_into_memory, str(_layout_copy(tmp_path, tied=True)), str(held), True, True)[0]
    _assert_same(got["state"], _tied(_state(1)))
    assert got["placed"] == {} and got["published"] and got["folder"] == str(held)


def test_a_stream_not_cut_is_received_into_the_folder_and_published(ranks, tmp_path: Path) -> None:
    """A replication's sender does not cut its stream: nothing can go into memory, the copy is kept."""
    held = tmp_path / "node" / "rank_00001"
    got = ranks(2).run(_into_memory, str(_layout_copy(tmp_path)), str(held), False)[0]
    assert got["placed"] == {} and got["published"] and got["folder"] == str(held)
    _assert_same(got["state"], _state(1))


@pytest.mark.parametrize("copied", [False, True], ids=["received", "copied"])
def test_a_flipped_byte_in_a_tensor_received_into_memory_is_caught(ranks, tmp_path: Path, copied: bool) -> None:
    own = _layout_copy(tmp_path)
    chunk = next(e.chunks[0] for e in _manifest(own).entries if e.fqn == "w")
    _flip_at(own / chunk.file, chunk.offset + chunk.nbytes // 2)
    held = tmp_path / "node" / "rank_00001"
    kind, message = ranks(2).run(_into_memory, str(own), str(held), True, False, copied)[0]
    assert kind == "CorruptCheckpointError" and "rank 1" in message and "entry w" in message, message
    assert not held.parent.exists() or os.listdir(held.parent) == []


def test_placed_entries_are_named_by_their_key_path_as_a_load_selects_them(ranks, tmp_path: Path) -> None:
    """A manifest whose recorded dotted name of ``w`` differs from its key path's (checksum sealed
    again, so it verifies): the loader selects by the key path, so ``w`` must be left out by that
    name, or it would load from the folder's hole (zeros) unchecked."""
    from zerostall.format.checksums import checksum
    from zerostall.format.envelope import checked_body

    own = _layout_copy(tmp_path)
    body = checked_body((own / MANIFEST_NAME).read_bytes(), str(own))
    forged = body.replace(b'"fqn":"w"', b'"fqn":"zzz"', 1)
    assert forged != body
    (own / MANIFEST_NAME).write_bytes(b'{"checksum":"' + checksum(forged).encode() + b'","manifest":' + forged + b"}\n")
    zs.verify(str(own))
    got = ranks(2).run(_into_memory, str(own), str(tmp_path / "node" / "rank_00001"))[0]
    assert sorted(got["placed"]) == ["w"] and all(got["placed"].values())
    _assert_same(got["state"], _state(1))


def _into_memory_failing(own: str, held: str) -> Any:
    """Rank 1 sends its copy, cut; rank 0 receives it into a zeroed state and returns the error and the state."""
    import torch.distributed as dist

    from zerostall.tiers.copies import placements, view
    from zerostall.tiers.transfer import exchange

    if dist.get_rank() == 1:
        return _exchange([(0, Path(own))], [], 1 << 16, cut=True)
    _checks_lag_at_first()
    state = {k: torch.zeros(1 << 20) for k in _six()}
    try:
        exchange(dist.group.WORLD, [], [(1, Path(held))], chunk_bytes=1 << 16,
                 place=functools.partial(placements, view(state, restoring=True)))
    except Exception as exc:
        return [type(exc).__name__, str(exc), state]
    return [None, "", state]


def _checks_lag_at_first() -> None:
    """The first check of each arriving file takes a second (a loaded machine): a failure is seen
    long after the chunks behind it have arrived."""
    import time

    from zerostall.loading.verification import ArrivingFile

    update, begun = ArrivingFile.update, set()

    def lagging(self: Any, data: Any) -> None:
        if id(self) not in begun:
            begun.add(id(self))
            time.sleep(1.0)
        update(self, data)

    ArrivingFile.update = lagging


def _six() -> dict:
    g = torch.Generator().manual_seed(6)
    return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(6)}


def test_once_a_check_fails_nothing_more_is_received_into_memory(ranks, tmp_path: Path) -> None:
    """Six tensors of 4 MiB, a data file each; a byte flipped in the first file: the copy fails,
    and the files of the next wave go to scratch buffers, never into the state unchecked."""
    from zerostall.tiers.copies import LAYOUT_KEY, view

    own = tmp_path / "own"
    zs.save(_six(), str(own), threads=6, metadata={LAYOUT_KEY: view(_six()).digest})
    manifest = _manifest(own)
    names = list(manifest.files)
    first, later = names[0], names[4:]  # the stream sends them in this order, four files a wave
    chunk = next(e.chunks[0] for e in manifest.entries if e.chunks and e.chunks[0].file == first)
    _flip_at(own / first, chunk.offset)
    kind, message, state = ranks(2).run(_into_memory_failing, str(own), str(tmp_path / "node" / "rank_00001"))[0]
    assert kind == "CorruptCheckpointError" and "checksum mismatch" in message, message
    untouched = [e.fqn for e in manifest.entries if e.chunks and e.chunks[0].file in later]
    assert len(untouched) == 2 and all(not state[k].any() for k in untouched)


def _send_nothing_receive_into_memory(own: str, held: str, elsewhere: str) -> Any:
    """Rank 0 sends a copy it lacks while it receives rank 1's into memory; rank 1 the other way."""
    import torch.distributed as dist

    from zerostall.tiers.copies import placements, view
    from zerostall.tiers.transfer import exchange

    if dist.get_rank() == 1:
        return _exchange([(0, Path(own))], [(0, Path(elsewhere))], 1 << 16, cut=True)
    state = _empty_like(_state(1))
    try:
        exchange(dist.group.WORLD, [(1, Path(held).parent / "missing")], [(1, Path(held))], chunk_bytes=1 << 16,
                 place=functools.partial(placements, view(state, restoring=True)))
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return None


def test_a_failed_send_removes_what_was_received_into_memory_beside_it(ranks, tmp_path: Path) -> None:
    held = tmp_path / "node" / "rank_00001"
    kind, message = ranks(2).run(_send_nothing_receive_into_memory, str(_layout_copy(tmp_path)), str(held),
                                 str(tmp_path / "other" / "rank_00000"))[0]
    assert kind == "CheckpointError" and "cannot send" in message, message
    assert os.listdir(held.parent) == []


def _flip_at(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _largest_data_file(folder: Path) -> Path:
    return max((p for p in folder.iterdir() if p.name != MANIFEST_NAME), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["block", "header", "size"])
def test_each_check_verify_makes_is_made_on_the_arriving_bytes(ranks, tmp_path: Path, damage: str) -> None:
    """Blocks of 1000 bytes, chunks of 4096 on the wire (blocks straddle chunks everywhere): a byte
    flipped in a block, one in a data file's safetensors header, a data file one byte longer than
    its manifest says: each is caught, named, and nothing is published."""
    own = tmp_path / "own"
    zs.save(_state(0), str(own), block_size=1000)
    target = _largest_data_file(own)
    data_start = min(c.offset for e in _manifest(own).entries if e.kind == "tensor" for c in e.chunks
                     if c.file == target.name)
    if damage == "block":
        _flip_at(target, data_start + 12345)  # in block 12 of the file's first chunk
        expected = "checksum mismatch"
    elif damage == "header":
        _flip_at(target, 20)
        expected = f"the safetensors header of data file {target.name} is damaged"
    else:
        with open(target, "ab") as f:
            f.write(b"\0")
        expected = f"has {target.stat().st_size} bytes, the manifest says {target.stat().st_size - 1}"
    held = tmp_path / "node_1" / "rank_00000"
    results = ranks(2).run_per_rank(_exchange, [([(1, own)], [], 4096), ([], [(0, held)], 4096)])
    kind, message = results[1]
    assert kind == "CorruptCheckpointError" and "rank 0" in message and expected in message, message
    assert target.name in message and "(as received)" in message
    if damage == "block":
        assert "block 12 " in message
    assert not held.parent.exists() or os.listdir(held.parent) == []


def _exchange_without_reading_back(sends: list, receives: list, chunk_bytes: int) -> list:
    """_exchange, with every way to read a data file back from local storage failing."""
    from zerostall.storage.local import LocalStorage

    def refused(*args, **kwargs):
        raise AssertionError("a received copy's data file was read back")

    saved = {name: getattr(LocalStorage, name) for name in ("read_into", "read_into_many", "read_head", "memory_map")}
    for name in saved:
        setattr(LocalStorage, name, refused)
    try:
        return _exchange(sends, receives, chunk_bytes)
    finally:
        for name, method in saved.items():
            setattr(LocalStorage, name, method)


def test_a_copy_is_checked_as_it_arrives_never_read_back(ranks, tmp_path: Path) -> None:
    """The receiver checks every block from the bytes it receives, before writing them: reading the
    files back (the cost that made a copy slower than the wire) is never needed."""
    own = _copies(tmp_path, 1)[0]
    held = tmp_path / "node_1" / "rank_00000"
    results = ranks(2).run_per_rank(_exchange_without_reading_back, [([(1, own)], [], 1 << 16),
                                                                     ([], [(0, held)], 1 << 16)])
    assert results == [[], [str(held)]]
    _assert_same(zs.load(_empty_like(_state(0)), str(held)), _state(0))


def test_a_received_copy_replaces_the_one_held(ranks, tmp_path: Path) -> None:
    own = _copies(tmp_path, 2)
    held = tmp_path / "node_1" / "rank_00000"
    zs.save(_state(7), str(held))
    results = ranks(2).run_per_rank(_exchange, [([(1, own[0])], [], 1 << 16), ([], [(0, held)], 1 << 16)])
    assert results == [[], [str(held)]]
    assert sorted(os.listdir(held.parent)) == ["rank_00000"]
    _assert_same(zs.load(_empty_like(_state(0)), str(held)), _state(0))


def _hostile_then_honest(name: str, held: str, own: str) -> list:
    """Rank 1 sends a header naming a manifest and ``name``, and their bytes; then a real copy, on the same pair."""
    import torch.distributed as dist

    from zerostall.tiers.stream import send_header

    if dist.get_rank() == 1:
        send_header(dist.group.WORLD, 0, {"files": [[MANIFEST_NAME, 4], [name, 4]], "chunk": 4096, "wave": 4,
                                          "cuts": [[], []]})
        for _ in range(2):
            dist.send(torch.zeros(4, dtype=torch.uint8), 0)
        return _exchange([(0, own)], [], 4096)
    return [_exchange([], [(1, Path(held))], 4096), _exchange([], [(1, Path(held))], 4096)]


@pytest.mark.parametrize("name", ["../escaped", "/tmp/absolute", "sub/dir", "..", ""])
def test_a_hostile_file_name_is_refused(ranks, tmp_path: Path, name: str) -> None:
    own = _copies(tmp_path, 2)[1]
    held = tmp_path / "node" / "step" / "rank_00001"
    hostile, honest = ranks(2).run(_hostile_then_honest, name, str(held), str(own))[0]
    assert hostile[0] in ("CorruptCheckpointError", "UnsafeFileError") and "rank 1" in hostile[1], hostile
    assert "not a plain file name" in hostile[1]
    assert not (tmp_path / "node" / "escaped").exists() and not (tmp_path / "node" / "step" / "escaped").exists()
    assert honest == [str(held)]  # the refused bytes were drained: the pair's next transfer works
    assert sorted(os.listdir(held.parent)) == ["rank_00001"]
    _assert_same(zs.load(_empty_like(_state(1)), str(held)), _state(1))


def _forged(files: list[tuple[str, str]], held: str) -> list:
    """Rank 1 sends the files given as (name, path of the bytes) as a copy, each in one chunk."""
    import torch.distributed as dist

    from zerostall.tiers.stream import send_header

    if dist.get_rank() == 0:
        return _exchange([], [(1, Path(held))], 1 << 20)
    data = [Path(path).read_bytes() for _, path in files]
    send_header(dist.group.WORLD, 0, {"files": [[name, len(d)] for (name, _), d in zip(files, data)],
                                      "chunk": 1 << 20, "wave": 1, "cuts": [[] for _ in files]})  # each in one chunk
    for d in data:
        if d:
            dist.send(torch.frombuffer(bytearray(d), dtype=torch.uint8), 0)
    return []


@pytest.mark.parametrize("change", ["extra file", "file left out", "manifest not first"])
def test_a_copy_that_is_not_its_manifest_s_files_is_refused(ranks, tmp_path: Path, change: str) -> None:
    """Only the manifest and the data files it lists, each checked, make a copy: a file it does not
    list (unchecked bytes), one left out, or a stream that does not start with the manifest is refused."""
    own = _copies(tmp_path, 1)[0]
    files = [(MANIFEST_NAME, str(own / MANIFEST_NAME))]
    files += [(p, str(own / p)) for p in sorted(os.listdir(own)) if p != MANIFEST_NAME]
    if change == "extra file":
        files.append(("notes.txt", str(own / MANIFEST_NAME)))
        expected = "not listed: ['notes.txt']"
    elif change == "file left out":
        expected = f"not sent: ['{files.pop()[0]}']"
    else:
        files.reverse()
        expected = "does not begin with manifest.json"
    held = tmp_path / "node" / "rank_00001"
    kind, message = ranks(2).run(_forged, files, str(held))[0]
    assert kind == "CorruptCheckpointError" and "rank 1" in message and expected in message
    assert not held.parent.exists() or os.listdir(held.parent) == []


def _header_only(header: dict, held: str) -> list:
    import torch.distributed as dist

    from zerostall.tiers.stream import send_header

    if dist.get_rank() == 0:
        return _exchange([], [(1, Path(held))], 4096)
    send_header(dist.group.WORLD, 0, header)
    return []


@pytest.mark.parametrize("header", [{"files": [[MANIFEST_NAME, 4]], "chunk": 0, "wave": 4, "cuts": [[]]},
                                    {"files": [[MANIFEST_NAME, 4]], "chunk": 1 << 40, "wave": 4, "cuts": [[]]},
                                    {"files": [[MANIFEST_NAME, -4]], "chunk": 4096, "wave": 4, "cuts": [[]]},
                                    {"files": [], "chunk": 4096, "wave": 4, "cuts": []},
                                    {"files": [[MANIFEST_NAME, 4]]},
                                    {"files": [[MANIFEST_NAME, 4]], "chunk": 4096, "wave": 4},
                                    {"files": [[MANIFEST_NAME, 4]], "chunk": 4096, "wave": 4, "cuts": [[4]]},
                                    {"files": [[MANIFEST_NAME, 9]], "chunk": 4096, "wave": 4, "cuts": [[3, 2]]},
                                    {"files": [[f"f{i}", 0] for i in range(5000)], "chunk": 4096, "wave": 4,
                                     "cuts": [[]] * 5000},
                                    [1]])
def test_a_malformed_header_is_refused(ranks, tmp_path: Path, header) -> None:
    held = tmp_path / "node" / "rank_00001"
    kind, message = ranks(2).run(_header_only, header, str(held))[0]
    assert kind == "CorruptCheckpointError" and "rank 1" in message and "wrong shape" in message
    assert not held.parent.exists()


def _silent_peer(timeout: float, held: str) -> list:
    """Rank 0 waits for a copy rank 1 never sends (a group with a short timeout)."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        return _exchange([], [(1, Path(held))], 4096, pg_timeout=timeout)
    dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    time.sleep(timeout + 2)
    return []


def _dies_while_sending(own: str, held: str) -> list:
    """Rank 1 sends a big copy to rank 0 and dies once part of it has arrived."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        folder = Path(held).parent

        def kill_when_arriving() -> None:
            def arriving() -> bool:
                try:
                    return any(f.stat().st_blocks for d in folder.glob(INCOMING + "*") for f in d.iterdir())
                except OSError:  # a folder or file that went meanwhile
                    return False
            wait_for(arriving, "the copy to arrive")
            os._exit(1)
        threading.Thread(target=kill_when_arriving, daemon=True).start()
        return _exchange([(0, Path(own))], [], 1 << 16, pg_timeout=60)
    return _exchange([], [(1, Path(held))], 1 << 16, pg_timeout=60)


def test_a_silent_or_dead_peer_fails_the_transfer_without_a_hang(tmp_path: Path) -> None:
    """A fresh pool (a dead worker tears it down). A peer that sends nothing: the receiver raises
    once the group's timeout passes; one that dies mid-transfer: the receiver raises, keeps nothing."""
    big = tmp_path / "big"
    zs.save({"x": torch.arange(16 << 20, dtype=torch.int64)}, str(big))  # 128 MiB in 64 KiB chunks
    held = tmp_path / "node" / "rank_00001"
    pool = RankPool(2)
    try:
        kind, message = pool.run(_silent_peer, 3.0, str(held), timeout=60)[0]
        assert kind == "LinkError" and "rank 1" in message and str(held) in message
        with pytest.raises(RankError) as caught:
            pool.run(_dies_while_sending, str(big), str(held), timeout=120)
    finally:
        pool.close()
    assert caught.value.dead == [1] and not caught.value.timed_out
    kind, message = caught.value.results[0]
    assert kind == "LinkError" and "rank 1" in message and str(held) in message
    assert not held.parent.exists() or os.listdir(held.parent) == []


def _out_of_step(own: str, held: str) -> list:
    """Rank 1 sends its copy as step 70's; rank 0 expects step 80's from it (their workers out of step).
    Rank 0 reads no further, so rank 1's send times out."""
    import torch.distributed as dist

    from zerostall.tiers.transfer import exchange

    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))  # broken after: never used again
    try:
        if dist.get_rank() == 1:
            exchange(pg, [(0, Path(own))], [], step=70, chunk_bytes=4096)
        else:
            exchange(pg, [], [(1, Path(held))], step=80, chunk_bytes=4096)
        return []
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    finally:
        dist.destroy_process_group(pg)


def test_a_copy_of_another_step_is_refused_as_a_broken_link(ranks, tmp_path: Path) -> None:
    """Nothing tied a copy to its step: two ranks out of step (one saving step 70 where the other
    saves step 80) filed each other's copies under the wrong step, and a restore took them for it."""
    own = _copies(tmp_path, 2)[1]
    held = tmp_path / "node" / "step_80" / "rank_00001"
    kind, message = ranks(2).run(_out_of_step, str(own), str(held), timeout=60)[0]
    assert kind == "LinkError" and "rank 1 sent a copy of step 70" in message and "of step 80" in message, message
    assert not held.exists()
