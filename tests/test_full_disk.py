"""A full disk (a small tmpfs this test mounts and fills): a checkpoint it has no space for is named as such, in one
line, and the node trains on; the checkpoint before stays the one a restart resumes; metrics rows wait in memory and
metrics.jsonl never holds a cut line; and once space returns the next save and the rows held go through."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from node.files import no_space
from node.loop import Node
from node.state import StateStore
from tests.helpers.mounts import fill, tmpfs

DISK_MB = 16  # the tiny model's checkpoint is well under 1 MB


def whole_rows(store: StateStore) -> list[int]:
    """The rounds in metrics.jsonl, every line of which must be a whole row."""
    lines = store.metrics_path.read_text().splitlines()
    return [json.loads(line)["round"] for line in lines]


def test_what_torch_and_safetensors_raise_on_a_full_disk_is_named_no_space(tmp_path):
    with tmpfs(tmp_path / "disk", 1) as disk:
        fill(disk)
        big = {"weights": torch.zeros(1 << 18)}
        with contextlib.suppress(OSError), open(disk / "trainer.pt", "wb") as handle:  # closing fails too
            with pytest.raises(RuntimeError) as torch_error:
                torch.save(big, handle)
        assert "unexpected pos" in str(torch_error.value)  # torch's words: nothing says the disk is full
        assert no_space(torch_error.value)
        with pytest.raises(Exception) as safetensors_error:
            save_file(big, str(disk / "model.safetensors"))
        assert no_space(safetensors_error.value)
        assert not no_space(RuntimeError("unexpected pos 10 vs 8"))  # a cut write for another reason is not


def test_a_full_disk_skips_the_checkpoint_keeps_the_last_and_saves_again_once_space_returns(
    tiny_config, tmp_path, caplog
):
    with tmpfs(tmp_path / "disk", DISK_MB) as disk:
        config = tiny_config(state_dir=disk / "state")  # checkpoint_every 1, checkpoint_keep 2
        node = Node(config)
        node.load()
        store = node.store

        async def rounds() -> int:
            """Two rounds, rounds on a full disk until a metrics row too finds no room, one once space is back;
            the last round on the full disk."""
            await node.start_services()
            try:
                for _ in range(2):
                    await node.run_round()
                filler = fill(disk)
                with caplog.at_level(logging.WARNING):
                    await node.run_round()  # round 3: no space for its checkpoint
                    # the disk stays full until a row too finds no space (the file's last page had room for some)
                    for _ in range(8):
                        if store.unwritten:
                            break
                        await node.run_round()
                    full_round = node.round
                    assert store.unwritten, "every row found room on a full disk"
                    assert whole_rows(store) == list(range(1, len(whole_rows(store)) + 1))
                    assert [row["round"] for row in store.unwritten] == list(
                        range(len(whole_rows(store)) + 1, full_round + 1)
                    )
                filler.unlink()  # space again
                await node.run_round()
            finally:
                await node.stop_services()
            return full_round

        full_round = asyncio.run(rounds())
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        for round_ in range(3, full_round + 1):
            assert (
                f"could not save round {round_}: no space left on device in {store.checkpoints} (the checkpoint of "
                f"round 2 stands); training goes on and saves again at round {round_ + 1}"
            ) in warnings
        held = [w for w in warnings if w.startswith("no space left on device for ")]
        assert held == [f"no space left on device for {store.metrics_path}: its rows are held in memory until there is"]
        assert not list(store.checkpoints.glob(".staging-*"))  # a failed save leaves nothing behind

        # space came back: the held rows, in order, then the round's own, and its checkpoint
        assert node.round == full_round + 1 and not store.unwritten
        assert whole_rows(store) == list(range(1, full_round + 2))
        assert store.latest().name == f"round-{full_round + 1:08d}"
        assert sorted(p.name for p in store.checkpoints.glob("round-*")) == [
            "round-00000002",
            f"round-{full_round + 1:08d}",
        ]
        resumed = StateStore(store.root).resume(config.model.dtype, config.checkpoint_every)
        assert resumed.state.round == full_round + 1
