"""Evaluation tasks: joint recall, MQAR, RULER-style, perplexity, LongBench,
lm-evaluation-harness."""


def results_table(results: dict) -> str:
    """One line per (task, metric), nested metrics joined by '/'."""
    rows = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            rows.append((prefix, f"{value:.4f}" if isinstance(value, float) else str(value)))

    walk("", results)
    width = max((len(name) for name, _ in rows), default=4)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
