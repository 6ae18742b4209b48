"""kt-ft's user-facing error: every problem found, each on its own line."""

from __future__ import annotations


class KTConfigError(ValueError):
    """Bad kt-ft configuration (recipe keys, rule file, model). Lists every problem at once."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = f"kt-ft: {self.problems[0]}"
        else:
            msg = f"kt-ft found {len(self.problems)} problems:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(msg)
