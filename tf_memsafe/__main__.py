"""``python -m tf_memsafe``: run a script or module with tf_memsafe enabled, then say what it did.

In the habit of ``python -m cProfile``::

    python -m tf_memsafe --memory-limit 4GB [--explain] [--disable-pass NAME ...] [--strict] script.py [args]
    python -m tf_memsafe --memory-limit 4GB -m module [args]

The script runs unchanged, as ``__main__``, with ``sys.argv`` set to the script and its arguments and
the script's folder first on ``sys.path`` (as ``python script.py`` would).  At exit, a summary goes
to stderr: one line per function traced while enabled: its name, status, the memory model's
estimate of the program as traced ("before"), XLA's "Total bytes used" of each program it
compiled during the run ("after", measured: XLA dumps into a private directory for the run, see
:func:`tf_memsafe.xla_flags.dump_all_compiles`; ``--no-measure`` turns that off), and the reason
or the number of rewrites; under it, for a function with inputs of run-time sizes, XLA's figure at each
larger shape it ran at (:mod:`tf_memsafe.run_check`); ``--explain`` adds each function's pass records.
The script's exit status is kept.  Bad arguments (a malformed ``--memory-limit``, a ``--disable-pass``
naming no known pass) get one error line and exit status 2, before the script starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import runpy
import sys
from collections import defaultdict
from collections.abc import Sequence

import tf_memsafe
from tf_memsafe import hook, xla_flags
from tf_memsafe.config import describe_unknown_passes, known_pass_names
from tf_memsafe.hook import TraceReport
from tf_memsafe.report import align_columns, format_records
from tf_memsafe.units import format_bytes, parse_memory_limit

PROG = "python -m tf_memsafe"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, no usage block: ``python -m tf_memsafe: error: ... (see --help)``."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _memory_limit(text: str) -> str:
    try:
        parse_memory_limit(text)
    except ValueError as e:  # its message names the accepted forms
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _pass_name(text: str) -> str:
    """A known pass name, checked while parsing: a typo stops the run before the script starts."""
    problem = describe_unknown_passes([text])
    if problem:  # one line: the name, close matches, the known passes
        raise argparse.ArgumentTypeError(problem)
    return text


def _parser() -> tuple[_Parser, set[str]]:
    """The parser, and the option strings that take a value (to find where the script's args start)."""
    parser = _Parser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [options] script.py [args ...]\n       {PROG} [options] -m module [args ...]",
        description="Run a Python script or module with tf_memsafe enabled: every "
                    "tf.function(jit_compile=True) it traces is rewritten to fit the memory limit. "
                    "At exit, a summary of the traced functions goes to stderr.",
        epilog="Everything after the script (or after -m MODULE) is passed to it unchanged. "
               "The script's exit status is kept.")
    actions = [
        parser.add_argument("--memory-limit", type=_memory_limit, default="80%", metavar="LIMIT",
                            help="limit on each compiled program's memory: '4GB', '512MiB', '1.5GiB', a number "
                                 "of bytes, or a percentage of the device's memory such as '80%%' "
                                 "(default: %(default)s)"),
        parser.add_argument("--disable-pass", action="append", default=[], metavar="NAME", type=_pass_name,
                            help="do not run the pass NAME (repeatable; one of: "
                                 f"{', '.join(sorted(known_pass_names()))})"),
        parser.add_argument("--strict", action="store_true",
                            help="raise instead of leaving a function as traced when a pass fails"),
        parser.add_argument("--redraw-random", action="store_true",
                            help="let the splitter split through random draws (dropout), each slice drawing "
                                 "its own values (Options.redraw_random)"),
        parser.add_argument("--explain", action="store_true",
                            help="also print every pass's records for each function"),
        parser.add_argument("--no-measure", action="store_true",
                            help="do not have XLA dump the run's programs to report their measured footprint"),
        parser.add_argument("-m", dest="module", metavar="MODULE",
                            help="run library module MODULE as a script (like python -m)"),
    ]
    parser.add_argument("script", nargs="?", help="the Python script to run")
    takes_value = {s for a in actions if a.nargs != 0 for s in a.option_strings}
    return parser, takes_value


def _split(argv: Sequence[str], takes_value: set[str]) -> tuple[list[str], list[str]]:
    """Our arguments, and the target's: ours end at the script, or just after ``-m MODULE``."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return list(argv[:i + 2]), list(argv[i + 2:])
        if tok == "-m":
            return list(argv[:i + 2]), list(argv[i + 2:])
        if tok.startswith("-m") and not tok.startswith("--"):  # -mmodule
            return list(argv[:i + 1]), list(argv[i + 1:])
        if not tok.startswith("-") or tok == "-":
            return list(argv[:i + 1]), list(argv[i + 1:])
        i += 2 if tok in takes_value else 1
    return list(argv), []


_MODULE_NAME = re.compile(r"^a_(inference|forward)_(.+?)_(\d+)__")


def _xla_programs(modules: Sequence[tuple[str, int]]) -> dict[str, dict[str, list[int]]]:
    """XLA's figures by function name and kind (``inference``, ``forward``, ``backward``), in compile order.

    TensorFlow names a function's XLA module ``a_inference_<name>_<uid>__...``; with a tape
    outside, ``a_forward_<name>_<uid>`` and ``a_inference___backward_<name>_<uid>_<uid>``.
    """
    out: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for module, total in modules:
        m = _MODULE_NAME.match(module)
        if not m:
            continue
        kind, name = m.group(1), m.group(2)
        if name.startswith("__backward_"):
            kind, name = "backward", re.sub(r"_\d+$", "", name[len("__backward_"):])
        out[name][kind].append(total)
    return out


def _measured(trace: TraceReport, index: int, programs) -> str:
    """The ``index``-th trace of its name's measured programs, as text."""
    kinds = programs.get(trace.function_name, {})
    parts = []
    for kind, label in (("inference", ""), ("forward", "fwd "), ("backward", "bwd ")):
        figures = kinds.get(kind, [])
        if index < len(figures):
            parts.append(label + format_bytes(figures[index]))
    return "XLA " + " + ".join(parts) if parts else "not compiled"


def _summary(traces: Sequence[TraceReport], explain: bool, modules: Sequence[tuple[str, int]] | None = None) -> str:
    if not traces:
        return "tf_memsafe: no tf.function was traced while enabled"
    n = len(traces)
    lines = [f"tf_memsafe: {n} function{'' if n == 1 else 's'} traced"]
    programs = _xla_programs(modules or [])
    seen: dict[str, int] = defaultdict(int)
    rows = []
    for t in traces:
        if t.status == "rewritten":
            k = sum(r.action == "rewritten" for r in t.records)
            detail = f"{k} rewrite{'' if k == 1 else 's'}"
        else:
            detail = t.reason
        limit = f"limit {format_bytes(t.memory_limit_bytes)}" if t.memory_limit_bytes is not None else "-"
        row = [t.function_name, t.status, limit]
        if modules is not None and t.retraced:
            row.append("never compiled")          # (the trace after it is the one compiled)
        elif modules is not None:
            before = f"model {format_bytes(t.model_before_bytes)}" if t.model_before_bytes is not None else "model ?"
            row.append(f"{before} -> {_measured(t, seen[t.function_name], programs)}")
            seen[t.function_name] += 1
        row.append("-" if t.rewrite_seconds is None else f"passes {t.rewrite_seconds:.2f} s")
        rows.append((*row, detail))
    for t, line in zip(traces, align_columns(rows)):
        lines.append("  " + line)
        lines += [f"      ran {check.render()}" for check in t.run_checks]
        if explain and t.pipeline is not None:
            lines += ["      " + record_line for record_line in format_records(t.records)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, takes_value = _parser()
    ours, target_args = _split(argv, takes_value)
    args = parser.parse_args(ours)
    if args.module and args.script:  # "-m mod" ends our options, so this is "script.py -m mod"
        parser.error("give a script or -m MODULE, not both")
    if not args.module and not args.script:
        parser.error("give a script to run, or -m MODULE")
    if args.script:
        if not os.path.isfile(args.script):
            parser.error(f"can't open file {args.script!r}: no such file")
        target = [args.script]
    else:
        try:
            spec = importlib.util.find_spec(args.module)
        except (ImportError, ValueError) as e:
            parser.error(f"cannot find module {args.module!r}: {e}")
        if spec is None:
            parser.error(f"no module named {args.module!r}")
        target = [args.module]

    try:
        tf_memsafe.enable(args.memory_limit, disabled_passes=args.disable_pass, strict=args.strict,
                          redraw_random=args.redraw_random)
    except (tf_memsafe.TfMemsafeError, ValueError, TypeError) as e:
        parser.exit(1, f"{PROG}: error: {e}\n")
    mark = hook.report_mark()
    sys.argv[:] = target + target_args
    measuring = contextlib.nullcontext(None) if args.no_measure else xla_flags.dump_all_compiles()
    with measuring as folder:
        try:
            if args.script:
                sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
                runpy.run_path(args.script, run_name="__main__")
            else:
                runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        finally:
            traces = hook.reports_since(mark)
            modules = xla_flags.memory_reports(folder) if folder else None
            sys.stdout.flush()
            print(_summary(traces, args.explain, modules), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
