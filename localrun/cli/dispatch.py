"""`main`: parse the command line, start the daemon when needed, run the verb, map errors to exit codes."""

from __future__ import annotations

import os
import sys

from localrun.cli.common import PROG, CLIError, UnknownOption, print_error
from localrun.cli.create import cmd_create
from localrun.cli.daemon import cmd_serve, cmd_version
from localrun.cli.launch import cmd_launch
from localrun.cli.loaded import cmd_ps, cmd_stop
from localrun.cli.models import cmd_cp, cmd_list, cmd_pull, cmd_rm, cmd_show
from localrun.cli.parser import build_parser
from localrun.cli.passthrough import passthrough_args, run_bench, run_ray_serve
from localrun.cli.run import cmd_chat, cmd_run, run_images, run_options
from localrun.client import APIError, DaemonClient, DaemonUnavailable, base_url_for
from localrun.config import parse_duration, parse_hostport
from localrun.errors import LocalrunError


VERBS = {"run": cmd_run, "chat": cmd_chat, "pull": cmd_pull, "list": cmd_list, "ls": cmd_list, "ps": cmd_ps,
         "show": cmd_show, "stop": cmd_stop, "rm": cmd_rm, "cp": cmd_cp, "create": cmd_create,
         "version": cmd_version, "launch": cmd_launch}


def _dispatch(argv: list[str]) -> int:
    rest = passthrough_args(argv)
    if rest is not None:
        return run_bench(rest)
    rest = passthrough_args(argv, "ray-serve")
    if rest is not None:  # runs without the daemon; imports Ray only here
        return run_ray_serve(rest)
    parser = build_parser()
    agent_args = None  # `launch AGENT ... -- ARGS`: ARGS go to the agent verbatim, in order
    if "--" in argv and "launch" in argv[:argv.index("--")]:
        agent_args, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    try:
        args, extra = parser.parse_known_args(argv)
        if agent_args is not None and args.command == "launch":
            args.agent_args = agent_args
        # `run MODEL --verbose PROMPT`: argparse stops filling `prompt` at the first option,
        # so words after an option arrive here; they belong to the prompt, as in Ollama.
        if extra and args.command == "launch":
            parser.error(f"unrecognized arguments: {' '.join(extra)} (arguments for the agent go after --)")
        elif extra and args.command == "run" and not any(e.startswith("-") for e in extra):
            args.prompt += extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse already printed
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None and not args.version:
        parser.print_help()
        return 0
    if args.command == "serve":
        args.host = args.serve_host or args.host
    if args.host:
        try:
            parse_hostport(args.host)
        except ValueError as exc:  # its message names LOCALRUN_HOST; the value came from the flag
            raise CLIError(f"--host: {str(exc).removeprefix('LOCALRUN_HOST: ')}") from None
    if args.command == "run":  # before any daemon is asked: a misspelled option is a usage error
        try:
            args.options = run_options(args.option)
        except UnknownOption as exc:
            try:
                args.verb_parsers["run"].error(f"argument -o/--option: {exc}")
            except SystemExit as stop:
                return stop.code if isinstance(stop.code, int) else 2
    if getattr(args, "keepalive", None) is not None:
        try:
            parse_duration(args.keepalive)
        except ValueError as exc:
            raise CLIError(f"--keepalive: {exc}") from None
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "run":  # a bad image file is the user's to fix before any daemon is asked
        args.prompt_text, args.attachments = run_images(args, " ".join(args.prompt))
    with DaemonClient(base_url_for(args.host)) as client:
        if args.version or args.command == "version":
            return cmd_version(args, client)
        client.ensure_running(autostart=not args.no_autostart)
        if client.started_pid:
            print(f"{PROG}: started the daemon at {client.base_url} (pid {client.started_pid})", file=sys.stderr)
        elif client.started_elsewhere:
            print(f"{PROG}: a daemon started meanwhile at {client.base_url} (by another command); using it",
                  file=sys.stderr)
        return VERBS[args.command](args, client)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `localrun list | head -1`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    except (DaemonUnavailable, APIError) as exc:
        print_error(exc.message)
        return 1
    except LocalrunError as exc:
        print_error(exc.message)
        return 1
    except (CLIError, ValueError, OSError) as exc:
        print_error(str(exc))
        return 1
    except Exception as exc:  # a bug: still one line, with a pointer for a report
        print_error(f"unexpected {type(exc).__name__}: {exc} (please report this)")
        return 1
