"""What the examples share: a progress bar, and reading a compiled step's memory."""

from collections.abc import Iterable


def progress(iterable: Iterable, total: int, desc: str):
    """A tqdm progress bar over `iterable`, or the iterable itself if tqdm (an
    optional dependency) is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(f"{desc}: training for {total} steps (install tqdm for a progress bar)")
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="step", leave=True)


def compiled_memory(compiled) -> dict[str, int] | None:
    """The sizes XLA reports for a compiled step, or `None` where the backend does
    not report them."""
    compiled = getattr(compiled, "compiled", compiled)  # An Equinox wrapper, or not.
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError):
        return None
    if stats is None:
        return None
    fields = ("argument", "output", "temp", "alias", "generated_code")
    return {f: int(getattr(stats, f"{f}_size_in_bytes", 0) or 0) for f in fields}


def step_bytes(memory: dict | None) -> int | None:
    """Argument + output + temporary bytes of a compiled step."""
    if memory is None:
        return None
    return memory["argument"] + memory["output"] + memory["temp"]


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def print_memory_analysis(results: list[dict]) -> None:
    """One line per variant: the sizes `compiled.memory_analysis()` reported."""
    print()
    print("compiled.memory_analysis() of the training step:")
    width = max(len(r["name"]) for r in results)
    for r in results:
        m = r["memory"]
        if m is None:
            print(
                f"  {r['name']:>{width}}: n/a (this backend reports no memory analysis)"
            )
            continue
        print(
            f"  {r['name']:>{width}}: argument {fmt_bytes(m['argument'])}, "
            f"output {fmt_bytes(m['output'])}, temp {fmt_bytes(m['temp'])} "
            f"(alias {fmt_bytes(m['alias'])}, code {fmt_bytes(m['generated_code'])})"
        )
