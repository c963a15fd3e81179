"""HAProxy left by a run that died is stopped by the next one (``disagg.launch.haproxy_dirs``).

Stand-ins: a copy of ``sleep`` named ``haproxy`` (what ``/proc`` shows is all the module
reads), a plain ``sleep`` that must survive, and owners that are alive (this process) or
dead (a finished child).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from disagg.launch.haproxy_dirs import PREFIX, reap_orphans, stop_recorded, write_owner


def _spawn(tmp_path, name: str) -> subprocess.Popen:
    exe = tmp_path / name
    shutil.copy(shutil.which("sleep"), exe)
    return subprocess.Popen([str(exe), "60"])


def _dir(tmp_path, name: str, pids: list[int], owner: str | None) -> str:
    folder = tmp_path / (PREFIX + name)
    folder.mkdir()
    (folder / "pids").write_text("".join(f"{p}\n" for p in pids))
    if owner == "me":
        write_owner(str(folder))
    elif owner is not None:
        (folder / "owner").write_text(owner)
    return str(folder)


def test_a_dead_owners_haproxy_is_stopped_and_its_dir_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    haproxy, other = _spawn(tmp_path, "haproxy"), _spawn(tmp_path, "sleeper")
    try:
        orphan = _dir(tmp_path, "orphan", [haproxy.pid, other.pid], f"{dead.pid} 12345\n")
        mine = _dir(tmp_path, "mine", [], "me")
        unowned = _dir(tmp_path, "unowned", [], None)
        assert reap_orphans(str(tmp_path)) == [haproxy.pid]
        assert haproxy.wait(timeout=10) is not None
        assert other.poll() is None  # not HAProxy: never signalled
        assert not os.path.exists(orphan)
        assert os.path.exists(mine) and os.path.exists(unowned)  # a live owner's; an unknown one
    finally:
        for p in (haproxy, other):
            p.kill()
            p.wait()


def test_stop_recorded_skips_pids_that_are_gone(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    folder = _dir(tmp_path, "x", [gone.pid], "me")
    assert stop_recorded(folder) == []
    assert not os.path.exists(folder)
