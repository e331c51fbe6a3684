"""`python -m localrun.healthcheck`: exit 0 when the daemon at LOCALRUN_HOST answers its version
endpoint (with LOCALRUN_API_KEY when one is set), 1 otherwise. The container images' HEALTHCHECK.

Standard library only and bounded (5 s), so a health probe never hangs or starts a daemon.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

from localrun.config import settings

TIMEOUT_S = 5.0


def check(timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    try:
        s = settings()
    except ValueError as exc:
        return False, f"bad settings: {exc}"
    url = s.base_url + "/api/version"
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    # no proxies: the daemon is on this machine
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            version = json.loads(r.read(4096)).get("version", "?")
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"
    return True, f"localrun {version} at {s.base_url}"


def main() -> int:
    ok, message = check()
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
