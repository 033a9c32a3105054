"""The command line: `python -m lab list | run | bench | eval | doctor` (and the plugins' commands).

Covered: listing strategies (text, or JSON with every parameter's spec), running one strategy on a prompt
(streaming text to stdout, stats to stderr; or one JSON object; optionally writing the trace file), the
benchmark (`lab.tools.bench`) and the perplexity-control evaluation (`eval mirostat`, `lab.tools.mirostat_eval`). Every
input goes through `lab.app.validation.validate_request` (or the bench's and the evaluation's own checks, which use it
too). Exit codes: 0 ok, 2 bad input ("error: ..." on stderr, no traceback), 3 the model could not be loaded,
130 interrupted (Ctrl-C).
Not covered: interactive chat, batch runs of many prompts (use the bench), reading traces back.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

from lab.engine.models import DEVICES, DTYPES, EMBEDDED_MODEL, ModelLoadError
from lab.engine.quant import PRECISIONS
from lab.params import InputError, param_specs
from lab.registry import by_family, registry

# Modules that add subcommands: each defines register(commands, evaluations, add_model_options), adds its parsers
# to `commands` (top-level) or `evaluations` (under `eval`) and sets `handler=fn(args) -> exit code` on them.
PLUGIN_MODULES: tuple[str, ...] = (
    "lab.training.distill.cli",
    "lab.training.cli",
    "lab.tools.tot_eval",
    "lab.tools.rlm_eval",
    "lab.tools.doctor",
)

EXIT_OK, EXIT_INPUT, EXIT_MODEL, EXIT_INTERRUPTED = 0, 2, 3, 130
DEVICE_HELP = "|".join(DEVICES)
DTYPE_HELP = "|".join(("auto", *DTYPES))
PRECISION_HELP = "|".join(PRECISIONS)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="embedded name, Hugging Face id or local directory")
    parser.add_argument("--device", default="auto", metavar=DEVICE_HELP, help="default: auto (CUDA > MPS > CPU)")
    parser.add_argument("--dtype", default="auto", metavar=DTYPE_HELP, help="default: auto")
    parser.add_argument("--seed", default="0", help="seed of the run's random generator (default 0)")
    parser.add_argument("--max-new-tokens", default=None, help="generation budget (default: the Params default)")


def _add_precision_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        default="auto",
        metavar=PRECISION_HELP,
        help="weight format of the linears: bf16 = float weights in --dtype, int8, int4, w4a8 (CPU; the GGUF's "
        "own 4-bit blocks for the embedded model, w4a8 with 8-bit activation blocks and integer dot products; with "
        "--dtype auto always bfloat16 activations, the low-bit kernels' fast ones), auto = chosen with the dtype by "
        "what the CPU supports and whether the C++ op is built (default: w4a8 on an AVX2 / AVX-512 CPU)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `lab` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="python -m lab", description="Decoding Lab: run LLM decoding strategies.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    listing = commands.add_parser("list", help="list the strategies by family")
    listing.add_argument("--json", action="store_true", help="print every strategy and its parameters as JSON")
    run = commands.add_parser("run", help="run one strategy on a prompt")
    run.add_argument("--strategy", required=True, help="strategy name (see `list`)")
    run.add_argument("--prompt", required=True, help="the prompt text, or - to read it from stdin")
    run.add_argument("--raw", action="store_true", help="skip the chat template")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a strategy parameter; repeatable")
    run.add_argument("--json", action="store_true", help="print one JSON object {text, token_ids, stats}")
    run.add_argument("--trace", metavar="FILE", help="write the trace JSON to FILE")
    _add_model_options(run)
    _add_precision_option(run)
    bench = commands.add_parser("bench", help="benchmark strategies against Hugging Face generate")
    bench.add_argument(
        "--strategies",
        required=True,
        help="comma-separated rows, each [LABEL=]NAME[@PRECISION] (a label takes --params LABEL.key=value); "
        "speedups are vs the first",
    )
    bench.add_argument("--prompts", default="builtin", help="builtin, a text file (one per line) or a JSON list")
    bench.add_argument("--repeat", default="1", help="runs per prompt and strategy (default 1)")
    bench.add_argument("--limit", default=None, help="use only the first K prompts")
    bench.add_argument("--json", action="store_true", help="print {config, rows} as JSON instead of a table")
    bench.add_argument("--no-hf", action="store_true", help="skip the hf-generate reference row")
    bench.add_argument(
        "--params", action="append", default=[], metavar="NAME.KEY=VALUE", help="a strategy parameter; repeatable"
    )
    bench.add_argument(
        "--hf-assist",
        metavar="prompt-lookup|self-draft[:L]|MODEL",
        help="add transformers assisted generation (prompt-lookup, self-draft[:L] or a model)",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="add a profiled pass: where each strategy's time goes (lab.engine.profile)",
    )
    bench.add_argument(
        "--llama-cpp", action="store_true", help="add llama-cpp-python's greedy decoding of the same GGUF as a row"
    )
    _add_model_options(bench)
    _add_precision_option(bench)
    evaluate = commands.add_parser("eval", help="evaluate a strategy (see `eval -h` for the evaluations)")
    evaluations = evaluate.add_subparsers(dest="evaluation", required=True)
    evaluate = evaluations.add_parser("mirostat", help="measure perplexity control (observed vs target surprise)")
    evaluate.add_argument("--taus", default="2,3,4,5", help="target surprises in bits, comma-separated")
    evaluate.add_argument("--baselines", default="top-k=40,top-k=5,top-p=0.9,top-p=1", help="comparison rows")
    evaluate.add_argument("--prompts", default="builtin", help="builtin, a text file (one per line) or a JSON list")
    evaluate.add_argument("--limit", default="8", help="use only the first K prompts (default 8)")
    evaluate.add_argument("--json", action="store_true", help="print {config, rows} as JSON instead of a table")
    _add_model_options(evaluate)
    evaluate.set_defaults(handler=cmd_eval)
    for module_name in PLUGIN_MODULES:
        importlib.import_module(module_name).register(commands, evaluations, _add_model_options)
    return parser


def _int_option(name: str, value: str | None) -> int | None:
    """An integer command-line option, or InputError naming it."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{name} must be an integer, got {value!r}.") from None


def parse_sets(items: list[str]) -> dict[str, str]:
    """`--set key=value` pairs as a dict of strings (build_params coerces them); later pairs win."""
    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--set expects key=value, got {item!r}.")
        values[key.strip()] = value.strip()
    return values


def cmd_list(args: argparse.Namespace) -> int:
    """Print the strategies grouped by family, or all of them as JSON."""
    if args.json:
        items = [strategy_dict(strategy) for strategy in registry().values()]
        print(json.dumps(items, indent=2))
        return EXIT_OK
    for family, members in by_family().items():
        if members:
            print(f"{family}:")
            for strategy in members:
                print(f"  {strategy.name:<14} {strategy.summary}")
    return EXIT_OK


def strategy_dict(strategy: Any) -> dict:
    """A strategy as JSON: name, family, summary, paper and every parameter's spec."""
    params = [spec.as_dict() for spec in param_specs(strategy.Params)]
    return {
        "name": strategy.name,
        "family": strategy.family,
        "summary": strategy.summary,
        "paper": strategy.paper,
        "params": params,
    }


def _read_prompt(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def _check_trace_path(path: str | None) -> None:
    """Fail before loading the model if the trace file cannot be written."""
    if path is not None and (not path.strip() or not Path(path).resolve().parent.is_dir()):
        raise InputError(f"Cannot write the trace to {path!r}: its directory does not exist.")


def run_request_from_args(args: argparse.Namespace) -> Any:
    """Validate everything `run` was given (before any model work); returns a RunRequest."""
    from lab.app.validation import validate_request

    params: dict[str, Any] = parse_sets(args.set)
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    _check_trace_path(args.trace)
    prompt = _read_prompt(args.prompt)
    return validate_request(
        args.strategy,
        prompt,
        params,
        chat=not args.raw,
        seed=args.seed,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        precision=args.precision,
    )


def cmd_run(args: argparse.Namespace) -> int:
    """Run one strategy: stream the text (or print JSON), stats on stderr, optionally write the trace."""
    from lab.app.runner import new_trace, prepare, stream_run
    from lab.engine.forward_path import choose
    from lab.engine.text import json_for_terminal, printable
    from lab.trace import TokenEmitted, summarize, to_json

    request = run_request_from_args(args)
    loaded, prompt_ids = prepare(request)
    path = choose(loaded, wait=True)  # a one-off process: load (or build) the op where it applies, as the bench does
    trace = new_trace(request, loaded, path)
    with closing(stream_run(request, loaded, prompt_ids, path)) as events:
        for event in events:
            trace.events.append(event)
            if not args.json and isinstance(event, TokenEmitted) and event.text:
                sys.stdout.write(printable(event.text))  # model text: no terminal escapes reach the terminal
                sys.stdout.flush()
    stats = summarize(trace.events).as_dict()
    stats.update(prompt_tokens=len(prompt_ids), strategy=request.strategy.name, model=request.model)
    stats.update(dtype=trace.dtype, precision=trace.precision, choice=trace.choice)
    if args.trace:
        _write_trace(args.trace, to_json(trace))
    if args.json:
        payload = {"text": trace.text, "token_ids": trace.token_ids, "stats": stats}
        print(json_for_terminal(json.dumps(payload, ensure_ascii=False)))
    else:
        print(flush=True)
        print(_stats_line(stats), file=sys.stderr)
        print(f"model: {trace.choice}", file=sys.stderr)  # its dtype and precision, and why
    return EXIT_OK


def _write_trace(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as error:
        raise InputError(f"Cannot write the trace to {path!r}: {error.strerror or error}.") from None


def _stats_line(stats: dict) -> str:
    return (
        f"[{stats['strategy']} {stats['precision']}] {stats['new_tokens']} tokens in {stats['wall_s']:.2f} s "
        f"({stats['tokens_per_s']:.1f} tok/s), prompt {stats['prompt_tokens']} tokens, "
        f"{stats['target_forwards']} target forwards ({stats['forwards_per_token']:.2f}/token), "
        f"stop: {stats['stop_reason']}"
    )


def _print_progress(done: int, total: int, message: str) -> None:
    print(f"[{done}/{total}] {message} ...", file=sys.stderr, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmark the strategies (and hf-generate) and print the table or JSON."""
    from lab.app.validation import validate_seed
    from lab.tools.bench import format_table, parse_param_overrides, run_bench

    max_new_tokens = _int_option("--max-new-tokens", args.max_new_tokens)
    result = run_bench(
        args.strategies.split(","),
        args.prompts,
        max_new_tokens=128 if max_new_tokens is None else max_new_tokens,
        repeat=_int_option("--repeat", args.repeat),
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        precision=args.precision,
        seed=validate_seed(args.seed),
        limit=_int_option("--limit", args.limit),
        hf=not args.no_hf,
        llama_cpp=args.llama_cpp,
        params=parse_param_overrides(args.params),
        hf_assist=args.hf_assist,
        profile=args.profile,
        progress=_print_progress,
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_table(result))
    return EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    """Run the perplexity-control evaluation (`lab.tools.mirostat_eval`) and print the table or JSON."""
    from lab.app.validation import validate_seed
    from lab.tools.mirostat_eval import DEFAULT_TOKENS, format_table, parse_floats, run_eval

    max_new_tokens = _int_option("--max-new-tokens", args.max_new_tokens)
    result = run_eval(
        parse_floats(args.taus, "--taus"),
        args.prompts,
        limit=_int_option("--limit", args.limit),
        max_new_tokens=DEFAULT_TOKENS if max_new_tokens is None else max_new_tokens,
        baselines=args.baselines,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        seed=validate_seed(args.seed),
        progress=_print_progress,
    )
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_table(result))
    return EXIT_OK


COMMANDS = {"list": cmd_list, "run": cmd_run, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the subcommand and return its exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed "usage ... error: ..." (or --help)
        return exit_.code if isinstance(exit_.code, int) else EXIT_INPUT
    try:
        handler = COMMANDS.get(args.command) or args.handler
        return handler(args)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INPUT
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_MODEL
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
