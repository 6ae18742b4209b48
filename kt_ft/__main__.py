"""``python -m kt_ft``: the ``kt-ft`` command (``kt_ft/integrations/cli/main.py``)."""

from kt_ft.integrations.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
