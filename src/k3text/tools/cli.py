"""Command-line plumbing shared by the tools: `python -m k3text.tools.NAME CONFIG [key=value ...]
[--flags]`, with the same config loading as every other entry point.

A tool may own a few integer `name=value` keys of its own (`batch=`, `context=`); they are
taken out before the rest go to `load_config` as config overrides.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence

from k3text.config import Config, ConfigError, load_config


def parser(prog: str, doc: str, tool_keys: Mapping[str, str] | None = None,
           ) -> argparse.ArgumentParser:
    """An ArgumentParser taking CONFIG and key=value items; `tool_keys` maps the tool's own keys
    to their help text."""
    epilog = None
    if tool_keys:
        width = max(len(key) for key in tool_keys) + 2
        epilog = "tool keys (not config keys):\n" + "\n".join(
            f"  {(key + '=N').ljust(width)}  {text}" for key, text in tool_keys.items())
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=epilog)
    p.add_argument("config", help="config file (e.g. configs/models/kimi-k3.yml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return p


def split_tool_keys(items: Sequence[str], names: Sequence[str],
                    ) -> tuple[list[str], dict[str, int]]:
    """(config overrides, {tool key: int}) from the key=value items."""
    overrides, values = [], {}
    for item in items:
        key, _, raw = item.partition("=")
        if key.strip() not in names:
            overrides.append(item)
            continue
        try:
            values[key.strip()] = int(raw)
        except ValueError:
            raise ConfigError(f"'{item}': {key.strip()} must be an integer") from None
        if values[key.strip()] < 0:
            raise ConfigError(f"'{item}': {key.strip()} must be >= 0")
    return overrides, values


def run(p: argparse.ArgumentParser, argv: Sequence[str] | None,
        body: Callable[[argparse.Namespace, Config, dict[str, int]], str],
        tool_keys: Sequence[str] = ()) -> int:
    """Parse, load the config, print `body(args, cfg, tool values)`; a config or argument
    problem ends in one line on stderr and exit status 2."""
    args = p.parse_intermixed_args(argv)
    try:
        overrides, values = split_tool_keys(args.overrides, tool_keys)
        cfg = load_config(args.config, overrides)
        print(body(args, cfg, values))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
