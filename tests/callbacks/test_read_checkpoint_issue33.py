"""Issue 33, messages: every weights-only refusal of a checkpoint, whatever torch's wording (a GLOBAL of a blocked
module such as ``posix.system``, an unknown GLOBAL, an object of a class), is our ValueError naming the file and what
it tried to load, and no message suggests loading the file with ``weights_only=False`` (running its code)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from callbacks.quant import read_checkpoint


class _CallsSystem:
    """Unpickling this calls ``os.system("true")`` (never unpickled here: only written)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


class _OpensAFile:
    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, ("/nonexistent/never-created", "w"))


class _Plain:
    """An instance of a class that is not allow-listed (a dataclass of hyper-parameters, say)."""

    def __init__(self) -> None:
        self.x = 1


@pytest.mark.parametrize(
    ("payload", "named"),
    [(_CallsSystem(), "system"), (_OpensAFile(), "open"), (_Plain(), "_Plain"), (torch.nn.Linear(2, 2), "Linear")],
    ids=["os_system", "open", "class_instance", "module"],
)
def test_a_refused_checkpoint_names_what_it_tried_to_load_and_never_advises_weights_only_false(
    payload: object, named: str, tmp_path: Path
) -> None:
    path = tmp_path / "in.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"x": payload}}, path)
    with pytest.raises(ValueError, match=rf"^{path} was refused: .*tried to load \S*{named}") as err:
        read_checkpoint(str(path))
    message = str(err.value)
    assert "weights_only=False" not in message and "weights_only` set to `False" not in message
    assert "Re-running" not in message and "add_safe_globals" not in message


def test_an_unreadable_file_says_so_without_torchs_advice(tmp_path: Path) -> None:
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"^{path} is not a checkpoint torch.load can read") as err:
        read_checkpoint(str(path))
    assert "weights_only=False" not in str(err.value)
