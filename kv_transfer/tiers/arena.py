"""A node-local shared-memory arena: one file under /dev/shm, mapped by every
worker process on the node.

The owner creates the file with a fixed size (``ftruncate``; pages are
committed on first touch unless ``prefault``) and unlinks it on close; other
processes ``attach`` by path. Where a CUDA device is visible the mapping can be
page-locked with ``cudaHostRegister`` so device copies from it run at pinned
speed; without CUDA ``pin`` is a recorded no-op.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid
import weakref


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def default_arena_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedArena:
    """A fixed-size, file-backed, shared, writable mapping.

    NOTES
    1. The mapping never grows or shrinks: ``size`` is fixed at creation.
    2. Only the creating process (``owner``) unlinks the file: on close, or
       when the arena is garbage-collected or the interpreter exits.
    """

    def __init__(self, path: str, size: int, owner: bool, pin: bool = False, prefault: bool = False):
        self.path = path
        self.size = size
        self.owner = owner
        flags = mmap.MAP_SHARED
        if prefault and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        self.pinned = False
        self._pinned_ptr = 0
        # the owner's file goes away even if close() is never called (GC or exit)
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if owner else None
        if pin:
            self._pin()

    @classmethod
    def create(cls, size: int, directory: str | None = None, pin: bool = False,
               prefault: bool = False) -> SharedArena:
        if size <= 0:
            raise ValueError("arena size must be positive")
        path = os.path.join(directory or default_arena_dir(), f"disagg-host-{os.getpid()}-{uuid.uuid4().hex[:12]}.arena")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            return cls(path, size, owner=True, pin=pin, prefault=prefault)
        except BaseException:  # no arena: no file left in shared memory either
            _unlink_quietly(path)
            raise

    @classmethod
    def attach(cls, path: str, size: int, pin: bool = False) -> SharedArena:
        return cls(path, size, owner=False, pin=pin)

    def _pin(self) -> None:
        try:
            import torch

            if not torch.cuda.is_available():
                return
            probe = torch.frombuffer(self._mmap, dtype=torch.uint8, count=1)
            ptr = probe.data_ptr()
            del probe
            err = torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0)
            if int(getattr(err, "value", err)) == 0:
                self.pinned, self._pinned_ptr = True, ptr
                # unregister before the mapping goes away even without close(): a stale
                # registration makes the next mapping at that address fail to pin
                self._unpin = weakref.finalize(self, _unregister_quietly, ptr)
        except (ImportError, RuntimeError, AttributeError):
            self.pinned = False

    def close(self) -> None:
        """Unmap (if no view is still exported) and, for the owner, unlink."""
        if self.pinned:
            self._unpin()
            self.pinned = False
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass  # a reader still holds a view: the mapping lives until it is dropped
        if self._unlink is not None:
            self._unlink()


def _unregister_quietly(ptr: int) -> None:
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown or no CUDA: nothing left to undo
        pass
