"""`python -m layerwise_hf SCRIPT [ARGS...]`: run an unchanged training script with `install()` in effect.

Like `python -m cProfile` or `coverage run`: the script runs as `__main__` with `sys.argv = [SCRIPT, *ARGS]` and its
folder first on `sys.path`; `-m MODULE` runs a module as `python -m MODULE` would. A SCRIPT that is not a file is
looked up as a command, such as `llamafactory-cli` or `trl`: an installed console script (its entry point is called
in this process, as `-m` runs a module) or a Python script on `PATH`. Under several processes, put the launcher where
the script was: `accelerate launch [--config_file F] -m layerwise_hf SCRIPT [ARGS...]`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import runpy
import shutil
import sys

from ..optim.clipping import CLIP_MODES

USAGE = "python -m layerwise_hf [-h] [--layerwise_clip MODE] [--layerwise_preflight] (SCRIPT | -m MODULE) [ARGS...]"
DESCRIPTION = (
    "Run a training script unchanged, with layerwise_hf.install() in effect: transformers' TrainingArguments, "
    "HfArgumentParser and Trainer, and every subclass (TRL's SFTConfig / SFTTrainer, ...), accept "
    "--optim <base>_layerwise (command line, YAML, JSON) and train layer-wise with it, as LayerwiseTrainer does; any "
    "other optim trains as before. Under several processes: accelerate launch [--config_file F] -m layerwise_hf "
    "SCRIPT [ARGS...]."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m layerwise_hf", usage=USAGE, description=DESCRIPTION)
    parser.add_argument(
        "--layerwise_clip",
        choices=list(CLIP_MODES),
        help="how max_grad_norm is applied with a layer-wise optim, as LayerwiseTrainingArguments.layerwise_clip: "
        "'exact' (the default: Trainer's global clipping; without gradient accumulation backward runs twice a step), "
        "'previous' (one pass, the previous step's global norm), 'per_param' or 'off'",
    )
    parser.add_argument(
        "--layerwise_preflight",
        action="store_true",
        default=None,
        help="as LayerwiseTrainingArguments.layerwise_preflight: plan the run's own step before the first one and "
        "warn when it will not fit the device (see `layerwise-hf plan`)",
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module as a script, as `python -m` does")
    parser.add_argument("script", nargs="?", metavar="SCRIPT", help="the training script (a .py file)")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    """
    Install, then run the script (or `-m` module) as `__main__` with its own arguments. Returns the exit status: 2
    (before anything is installed or run) when the script does not exist or the module cannot be found.

    Args:
        argv (`list[str]`, *optional*, defaults to `sys.argv[1:]`):
            `[SCRIPT, *ARGS]` or `["-m", MODULE, *ARGS]`.

    Example:

    ```python
    >>> from layerwise_hf.integrations.launcher import main
    >>> main(["train.py", "--optim", "adamw_8bit_layerwise", "--output_dir", "out"])  # as the command line does
    0
    ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # NOTE: everything after SCRIPT / -m MODULE belongs to the script, so only the options before it are parsed here
    # (the script's own -h, -m, --optim ... must reach it untouched).
    head, module, script, rest = _split(argv)
    options = parser.parse_args(head)  # -h, or a wrong launcher option: argparse prints and exits
    if module is None and script is None:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: give the SCRIPT to run, or -m MODULE", file=sys.stderr)
        return 2
    command = None
    if module is None and not os.path.exists(script):
        command = find_command(script)
    problem = (
        None if command is not None else _module_problem(module) if module is not None else _script_problem(script)
    )
    if problem:
        print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2

    from .patching import UnsupportedVersionError, install

    try:
        install(layerwise_clip=options.layerwise_clip, layerwise_preflight=options.layerwise_preflight)
    except UnsupportedVersionError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    try:
        return _run(module, script, rest, command)
    except BaseException as err:
        _hint_misplaced_options(err, rest, module or script)
        raise


_OPTIONS_WITH_VALUE = ("--layerwise_clip",)


def _split(argv: list[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """(launcher options, module, script, the script's arguments)."""
    takes_value = False
    for i, arg in enumerate(argv):
        if takes_value:
            takes_value = False
            continue
        if arg in _OPTIONS_WITH_VALUE:
            takes_value = True
        elif arg == "-m":
            if i + 1 >= len(argv):
                return argv[: i + 1], None, None, []  # argparse reports "-m: expected one argument"
            return argv[:i], argv[i + 1], None, argv[i + 2 :]
        elif arg.startswith("-m") and len(arg) > 2:
            return argv[:i], arg[2:], None, argv[i + 1 :]
        elif arg == "--":
            return argv[:i], None, (argv[i + 1] if i + 1 < len(argv) else None), argv[i + 2 :]
        elif not arg.startswith("-"):
            return argv[:i], None, arg, argv[i + 1 :]
    return argv, None, None, []


def _hint_misplaced_options(err: BaseException, rest: list[str], target: str) -> None:
    """When the script failed and a launcher option came after it (so the script got it), say where it goes."""
    if isinstance(err, SystemExit) and err.code in (0, None):
        return
    if isinstance(err, KeyboardInterrupt):
        return
    options = []
    for i, arg in enumerate(rest):
        if arg.split("=", 1)[0] in ("--layerwise_clip", "--layerwise_preflight"):
            options.append(arg)
            if arg == "--layerwise_clip" and i + 1 < len(rest):
                options.append(rest[i + 1])
    if not options:
        return
    note = (
        f"python -m layerwise_hf: note: {' '.join(options)} came after {target}, so {target} got it; the launcher's "
        f"options go before the script: python -m layerwise_hf {' '.join(options)} {target} ..."
    )
    if not isinstance(err, SystemExit) and hasattr(err, "add_note"):
        err.add_note(note)  # printed under the traceback, where the user reads last
    else:
        print(note, file=sys.stderr)


class Command:
    """A command found by name: an installed console script's entry point, or a Python script on `PATH`."""

    def __init__(self, name: str, entry_point: importlib.metadata.EntryPoint | None = None, path: str | None = None):
        self.name, self.entry_point, self.path = name, entry_point, path

    def __repr__(self) -> str:
        return f"Command({self.name!r}, {self.entry_point.value if self.entry_point else self.path!r})"


def find_command(name: str) -> Command | None:
    """
    The command `name` (not a file): an installed console script (`[project.scripts]` entry point) of this Python,
    else a Python script of that name on `PATH`; None when neither exists.

    Example:

    ```python
    >>> from layerwise_hf.integrations.launcher import find_command
    >>> find_command("layerwise-hf")
    Command('layerwise-hf', 'layerwise_hf.cli:main')
    ```
    """
    if os.sep in name or (os.altsep and os.altsep in name):
        return None  # a path, not a command name
    # NOTE: entry points first: PATH may lead to another environment's copy of the command.
    found = importlib.metadata.entry_points(group="console_scripts", name=name)
    for entry_point in found:
        return Command(name, entry_point=entry_point)
    path = shutil.which(name)
    if path is not None and _is_python_script(path):
        return Command(name, path=path)
    return None


def _is_python_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _script_problem(script: str) -> str | None:
    if not os.path.exists(script):
        path = shutil.which(script) if os.sep not in script else None
        if path is not None:
            return (
                f"{script!r} is not a file here, and the command {path} is not a Python script, so it cannot run "
                f"with install() in effect; run its Python module instead: python -m layerwise_hf -m MODULE [ARGS...]"
            )
        return (
            f"can't open file {script!r}: no such file, and no installed console script or Python script on PATH "
            f"has that name; give the script's path, or run a module: python -m layerwise_hf -m MODULE [ARGS...] "
            f"(e.g. -m llamafactory.cli train cfg.yaml)"
        )
    if os.path.isdir(script) and not os.path.exists(os.path.join(script, "__main__.py")):
        return f"can't find '__main__' module in {script!r}"
    return None


def _module_problem(module: str) -> str | None:
    # NOTE: find_spec imports the parent packages (as `python -m` does); an error there is the module's own.
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as err:
        return f"No module named {err.name!r} (while looking for -m {module})"
    except ValueError as err:
        return f"-m {module}: {err}"
    finally:
        sys.path.pop(0)
    if spec is None:
        return f"No module named {module!r}"
    if spec.submodule_search_locations is not None and importlib.util.find_spec(f"{module}.__main__") is None:
        return f"No module named {module}.__main__; {module!r} is a package and cannot be directly executed"
    return None


def _run(module: str | None, script: str | None, rest: list[str], command: Command | None = None) -> int:
    if command is not None and command.entry_point is not None:
        # As the console script's wrapper does: sys.argv[0] its name, then `sys.exit(entry_point())`.
        sys.argv = [command.name, *rest]
        return _exit_status(command.entry_point.load()())
    if command is not None:
        script = command.path
    if module is not None:
        # As `python -m`: the current directory first on sys.path, sys.argv[0] the module's file.
        sys.argv = [module, *rest]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


def _exit_status(result) -> int:
    """What `sys.exit(result)` would exit with: None is 0, an int itself, anything else printed and 1."""
    if result is None:
        return 0
    if isinstance(result, int):
        return result
    print(result, file=sys.stderr)
    return 1
