"""`metrale adapters list|load|promote|swap|unload`: a thin client of a running
server's native adapter endpoints (urllib only, no extra dependencies)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request


class ClientError(Exception):
    pass


def call(url: str, method: str, path: str, key: str | None = None, body: dict | None = None,
         timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ClientError(f"HTTP {e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise ClientError(f"cannot reach {url}: {e.reason}") from None


def _print_table(listing: dict) -> None:
    print(f"model {listing['model']}  default adapter: {listing['default_adapter'] or '-'}")
    print(f"{'adapter':<24} {'slot':>4} {'state':<8} {'pinned':<6} {'in-flight':>9}  path")
    for a in listing["adapters"]:
        slot = "-" if a["slot"] is None else a["slot"]
        state = a["state"] + ("*" if a["unloading"] else "")
        print(f"{a['name']:<24} {slot:>4} {state:<8} {str(a['pinned']).lower():<6} "
              f"{a['ref_count']:>9}  {a['path'] or '-'}")


def run(args: argparse.Namespace) -> int:
    key = args.admin_key or os.environ.get("METRALE_ADMIN_KEY") or \
        os.environ.get("METRALE_API_KEY")
    try:
        if args.action == "list":
            listing = call(args.url, "GET", "/v1/adapters", key)
            if args.json:
                print(json.dumps(listing, indent=2))
            else:
                _print_table(listing)
            return 0
        name = urllib.parse.quote(args.name, safe="")  # a name may hold '/'
        if args.action == "load":
            result = call(args.url, "POST", "/v1/adapters", key,
                          {"name": args.name, "path": args.path, "pinned": args.pinned})
        elif args.action == "promote":
            result = call(args.url, "POST", f"/v1/adapters/{name}/promote", key)
        elif args.action == "swap":
            result = call(args.url, "POST", f"/v1/adapters/{name}/swap", key, {"slot": args.slot})
        else:
            result = call(args.url, "DELETE", f"/v1/adapters/{name}", key)
    except ClientError as e:
        print(f"metrale: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


def add_adapters_parser(sub) -> None:
    """The `adapters` subcommand, added to metrale's CLI by cli.build_parser."""
    p = sub.add_parser("adapters", help="manage the adapters of a running `metrale serve`")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server's base URL (default: %(default)s)")
    common.add_argument("--admin-key", help="the server's admin key (or set METRALE_ADMIN_KEY)")
    actions = p.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("list", parents=[common], help="registered adapters and slots")
    ls.add_argument("--json", action="store_true", help="print the server's JSON answer as is")
    load = actions.add_parser("load", parents=[common], help="register an adapter directory "
                              "(inside the server's --adapter-root)")
    load.add_argument("name", help="name requests will use as `model`")
    load.add_argument("path", help="adapter directory, relative to the server's --adapter-root")
    load.add_argument("--pinned", action="store_true",
                      help="keep it resident in a slot, never evicted")
    promote = actions.add_parser("promote", parents=[common], help="make an adapter resident")
    promote.add_argument("name", help="a registered adapter")
    swap = actions.add_parser("swap", parents=[common], help="land an adapter in a given slot")
    swap.add_argument("name", help="a registered adapter")
    swap.add_argument("slot", type=int, help="slot index, 0 to --max-loras minus 1")
    unload = actions.add_parser("unload", parents=[common], help="unregister and free its slot")
    unload.add_argument("name", help="a registered adapter")
    p.set_defaults(func=run)
