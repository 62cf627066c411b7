"""Atomic writes and the --force rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hloopt import fileio
from hloopt.errors import UserError
from hloopt.fileio import MARKER, is_ours, write_text_atomic


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_new_file_is_written_with_umask_permissions(tmp_path: Path) -> None:
    path = tmp_path / "policy.py"
    write_text_atomic(path, f"# {MARKER}\nx = 'é'\n")
    assert path.read_text(encoding="utf-8") == f"# {MARKER}\nx = 'é'\n"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert _leftovers(tmp_path) == []


def test_a_file_we_wrote_is_replaced_and_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "plan.py"
    write_text_atomic(path, f"# {MARKER}\nold\n")
    path.chmod(0o640)
    write_text_atomic(path, f"# {MARKER}\nnew\n")
    assert path.read_text() == f"# {MARKER}\nnew\n"
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_stranger_file_needs_force(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text("import jax\n# my training script\n")
    with pytest.raises(UserError) as err:
        write_text_atomic(path, "new")
    assert str(err.value) == f"{path} exists: pass --force to overwrite"
    assert path.read_text() == "import jax\n# my training script\n"
    write_text_atomic(path, "new", force=True)
    assert path.read_text() == "new"


def test_what_counts_as_ours(tmp_path: Path) -> None:
    cases = {
        "empty.txt": ("", True),
        "blank.txt": ("\n \n", True),
        "snippet.py": (f"# {MARKER} (hloopt.plan/1): checkpoint policy\n", True),
        # A plan: sorted keys put "schema" after a long decision list, beyond the sniffed head.
        "plan.json": ('{"decisions": [' + ",".join(['{"k": 1}'] * 2000) + '], "schema": "hloopt.plan/1"}', True),
        "other.json": ('{"schema": "someone-else/1"}', False),
        "broken.json": ("{not json", False),
        "config.yml": ("remat_policy: full\n", False),
    }
    for name, (text, ours) in cases.items():
        (tmp_path / name).write_text(text)
        assert is_ours(tmp_path / name) is ours, name
    assert not is_ours(tmp_path / "missing")


def test_an_error_while_writing_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"schema": "hloopt.plan/1"}')

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", fail)
    with pytest.raises(UserError, match=r"plan.json: cannot write: No space left on device$"):
        write_text_atomic(path, "x" * 100_000)
    assert path.read_text() == '{"schema": "hloopt.plan/1"}'
    assert _leftovers(tmp_path) == []


def test_interrupt_while_writing_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "out.py"

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fileio.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "data")
    assert not path.exists()
    assert _leftovers(tmp_path) == []


def test_folders_and_missing_parents(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is a folder; give a file name"):
        write_text_atomic(tmp_path, "x")
    with pytest.raises(UserError, match="no such folder"):
        write_text_atomic(tmp_path / "nope" / "f.txt", "x")


def test_symlink_target_is_replaced(tmp_path: Path) -> None:
    real = tmp_path / "real.py"
    real.write_text(f"# {MARKER}\n")
    link = tmp_path / "link.py"
    link.symlink_to(real)
    write_text_atomic(link, f"# {MARKER}\nv2\n")
    assert link.is_symlink()
    assert real.read_text() == f"# {MARKER}\nv2\n"
