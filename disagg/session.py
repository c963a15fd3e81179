"""Session identity: one key per (tenant cache salt, session id), used everywhere.

A session belongs to a tenant: one session id sent under two cache salts is two
sessions (two tenants never share routing affinity, a worker's publish queue or
device-resident state). The worker, the router's load tracker and the Serve
affinity router all key sessions with ``session_key``.

    session_key("", "s1")      == "s1"
    session_key("t0", "s1")    == "t0\\x00s1"
    session_key("t0", None)    == ""          (no session: nothing to key)

NOTES
1. The key lives in memory only (router load tracking, worker publish groups,
   rendezvous weights): nothing persisted is derived from it, so its format may
   change between releases without a migration.
2. NUL separates the parts: with API keys a salt is a hex digest
   (``disagg.api.limits.tenant_salt``), so a salted key cannot equal another
   tenant's.
"""

from __future__ import annotations


def session_key(cache_salt: str, session_id: str | None) -> str:
    """The tenant-scoped key of a session ("" when the request names no session)."""
    if not session_id:
        return ""
    return f"{cache_salt}\x00{session_id}" if cache_salt else session_id
