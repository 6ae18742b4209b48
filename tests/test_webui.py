"""LlamaBoard (``llamafactory-cli webui``) with kt-ft's fields on the Train tab.

The fast tests build the board's Train tab in process (no server, no browser) and check the
arguments it would launch; the slow one drives a real board in headless Chromium: the demo model
and dataset, ``use_kt`` ticked, a rule picked, the plan shown, a bad rule refused with kt-ft's
message, then a short run whose loss reaches the board and ``trainer_log.jsonl``.

The browser test needs selenium, Chromium and its driver (Debian: ``apt-get install chromium
chromium-driver``; ``pip install selenium``); it is skipped, saying which is missing, without them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("llamafactory")
pytest.importorskip("gradio")

from helpers.lf_runs import REPO  # noqa: E402

from kt_ft.base.errors import KTConfigError  # noqa: E402

EXTRA_ARGS = {  # the board's "Extra arguments" box: a short run on 2 cores
    "optim": "adamw_torch",
    "max_steps": 3,
    "logging_steps": 1,
    "save_steps": 100,
    "preprocessing_num_workers": 1,
    "dataloader_num_workers": 0,
    "overwrite_cache": True,
    "report_to": "none",
    "plot_loss": False,
}


@pytest.fixture
def train_tab(tmp_path, monkeypatch):
    """(engine, elements by id, blocks) of a board with the top bar and the Train tab, built in process;
    the board writes its caches under the working directory: a temporary one."""
    monkeypatch.chdir(tmp_path)
    import gradio as gr
    from llamafactory.webui.components import create_top, create_train_tab
    from llamafactory.webui.engine import Engine

    engine = Engine()
    with gr.Blocks() as blocks:
        engine.manager.add_elems("top", create_top())
        with gr.Tab("Train"):
            engine.manager.add_elems("train", create_train_tab(engine))
    return engine, dict(engine.manager._id_to_elem), blocks


def form_data(elems: dict, **values) -> dict:
    """component -> value as a click sends it: each element's default, ``values`` (by id, with
    ``__`` for the dot) on top."""
    data = {elem: getattr(elem, "value", None) for elem in elems.values()}
    for key, value in values.items():
        data[elems[key.replace("__", ".")]] = value
    return data


def demo_form(elems: dict, demo_assets: Path, **values) -> dict:
    return form_data(
        elems,
        top__lang="en",
        top__model_name="Custom",
        top__model_path=str(demo_assets / "model"),
        top__template="qwen",
        train__dataset_dir=str(demo_assets / "data"),
        train__dataset=["kt_demo"],
        train__output_dir="run",
        **values,
    )


def test_the_train_tab_has_the_kt_ft_fields_in_its_inputs(train_tab):
    _, elems, blocks = train_tab
    keys = ("use_kt", "kt_optimize_rule", "kt_backend", "cpu_infer", "chunk_size", "kt_gpu_memory")
    # the start, preview and save buttons send them: they are among the inputs of their clicks
    for button in ("start_btn", "cmd_preview_btn", "arg_save_btn"):
        target = elems[f"train.{button}"]._id
        (fn,) = [fn for fn in blocks.fns.values() if any(t[0] == target for t in fn.targets)]
        assert {elems[f"train.{k}"]._id for k in keys} <= {i._id for i in fn.inputs}, button
    # shown above the buttons, not below the output box
    tab = elems["train.start_btn"].parent.parent
    assert (
        tab.children.index(elems["train.kt_tab"]) == tab.children.index(elems["train.start_btn"].parent) - 1
    )
    from llamafactory.webui.locales import LOCALES

    assert LOCALES["use_kt"]["zh"]["label"] == "use_kt"  # every board language labels the fields


def test_ticked_use_kt_reaches_the_train_args(train_tab, demo_assets):
    engine, elems, _ = train_tab
    data = demo_form(
        elems,
        demo_assets,
        train__use_kt=True,
        train__kt_optimize_rule="qwen3_moe-torch",
        train__kt_backend="torch",
        train__cpu_infer=2.0,  # gradio's Number hands floats back
        train__chunk_size=256.0,
        train__kt_gpu_memory=12.5,
    )
    args = engine.runner._parse_train_args(data)
    assert {k: args[k] for k in ("use_kt", "kt_optimize_rule", "kt_backend", "cpu_infer", "chunk_size")} == {
        "use_kt": True,
        "kt_optimize_rule": "qwen3_moe-torch",
        "kt_backend": "torch",
        "cpu_infer": 2,
        "chunk_size": 256,
    }
    assert args["kt_gpu_memory"] == 12.5 and isinstance(args["cpu_infer"], int)
    assert args["trust_remote_code"] is False  # remote code has per-expert modules kt-ft cannot replace
    assert engine.runner._initialize(data, do_train=True, from_preview=True) == ""


def test_unticked_use_kt_leaves_the_args_as_llamafactory_builds_them(train_tab, demo_assets):
    engine, elems, _ = train_tab
    args = engine.runner._parse_train_args(demo_form(elems, demo_assets, train__kt_optimize_rule="nope"))
    assert not any(k.startswith("kt_") or k in ("use_kt", "cpu_infer", "chunk_size") for k in args)
    assert args["trust_remote_code"] is True


def test_extra_arguments_win_over_the_fields(train_tab, demo_assets):
    engine, elems, _ = train_tab
    extra = json.dumps({"chunk_size": 64, "trust_remote_code": True})
    data = demo_form(elems, demo_assets, train__use_kt=True, train__extra_args=extra)
    args = engine.runner._parse_train_args(data)
    assert (args["chunk_size"], args["trust_remote_code"], args["kt_backend"]) == (64, True, "auto")
    assert "kt_optimize_rule" not in args and "cpu_infer" not in args  # empty: the run's defaults


def test_bad_values_give_kt_ft_messages_naming_the_file_it_writes(train_tab, demo_assets):
    engine, elems, _ = train_tab
    data = demo_form(
        elems,
        demo_assets,
        train__use_kt=True,
        train__kt_optimize_rule="nope",
        train__cpu_infer=-2.0,
        top__finetuning_type="full",
    )
    error = engine.runner._initialize(data, do_train=True, from_preview=True)
    source = os.path.join("saves", "Custom", "full", "run", "training_args.yaml")
    assert error.startswith("kt-ft found 3 problems:"), error
    assert f"{source}: kt_optimize_rule='nope': no such file and no built-in rule of that name" in error
    assert "built-in rules: deepseek_v2, " in error and "qwen3_moe" in error
    assert f"{source}: cpu_infer=-2 is invalid" in error
    assert f"{source}: finetuning_type='full' with use_kt" in error and "valid: lora" in error


def test_the_board_check_is_the_command_line_check():
    """The board's message is the one a recipe with the same keys gets from the parser."""
    from kt_ft.integrations.llamafactory.webui import check_train_args
    from kt_ft.plan.recipe import KTArguments

    args = {"use_kt": True, "kt_optimize_rule": "nope", "output_dir": "out", "finetuning_type": "lora"}
    with pytest.raises(KTConfigError) as board:
        check_train_args({**args, "stage": "sft"})
    recipe = KTArguments(kt_optimize_rule="nope")
    recipe.use_kt = True
    with pytest.raises(KTConfigError) as cli:
        recipe.validate_kt(source=os.path.join("out", "training_args.yaml"))
    assert str(board.value) == str(cli.value)


def test_plan_preview_is_rules_plans_report(demo_assets):
    from kt_ft.integrations.llamafactory.webui import plan_markdown
    from kt_ft.runtime.rules_plan import PlanRequest, format_plan, plan_report

    model = str(demo_assets / "model")
    text = plan_markdown(model, None, "auto", 2.0, None, 64, 2, 8)
    report = plan_report(PlanRequest(rule="qwen3_moe", model=model, cutoff_len=64, batch=2, cpu_infer=2))
    assert text.startswith("rule `qwen3_moe` (the family default): fits the budget")
    assert format_plan(report, model) in text
    bad = plan_markdown(model, "nope", "auto", None, None, 64, 2, 8)
    assert "LlamaBoard: kt_optimize_rule='nope': no such file and no built-in rule" in bad
    assert "set the model path" in plan_markdown("", None, "auto", None, None, 64, 2, 8)


# ---- the board in a browser ------------------------------------------------------------------


def _browser_parts() -> tuple[str | None, str | None, str | None]:
    """(chromium, chromedriver, why not) for the browser test."""
    if importlib.util.find_spec("selenium") is None:
        return None, None, "selenium is not installed (pip install selenium)"
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver)) if p is None)
        return None, None, f"{missing} not found on PATH (Debian: apt-get install chromium chromium-driver)"
    return browser, driver, None


BROWSER, DRIVER, NO_BROWSER = _browser_parts()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def board(tmp_path):
    """``llamafactory-cli webui`` on a free localhost port, working directory ``tmp_path``; stopped
    with SIGINT (its Ctrl-C) at the end, which must exit 0."""
    port = _free_port()
    bin_dir = Path(sys.executable).parent
    log_path = tmp_path / "webui.log"
    env = {
        **os.environ,
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "BROWSER": "true",  # launch(inbrowser=True) would open the system's browser
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",  # the board runs `llamafactory-cli train`
    }
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(bin_dir / "llamafactory-cli"), "webui"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"webui exited {proc.returncode}\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("webui not up after 120 s\n" + log_path.read_text()[-3000:])
                time.sleep(0.3)
        yield url, tmp_path, log_path
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        assert rc == 0, f"webui exited {rc} on SIGINT\n{log_path.read_text()[-3000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,2400",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The board's fields by their (English) labels, as a user fills them in."""

    def __init__(self, driver) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        self.d, self.By, self.Keys = driver, By, Keys

    def wait(self, what, timeout: float = 60, message: str = ""):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = what()
            except AssertionError:
                raise
            except Exception:  # an element not there yet, or replaced while read
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout} s: {message}\n--- page:\n{self.text()[-3000:]}"
                )
            time.sleep(0.2)

    def text(self) -> str:
        return self.d.find_element(self.By.TAG_NAME, "body").text

    def field(self, label: str):
        """The first visible input / textarea of the block labelled ``label``."""
        xpath = (
            f"//span[@data-testid='block-info' and normalize-space()='{label}']"
            "/ancestor::div[contains(@class,'block')][1]//*[self::input or self::textarea]"
        )
        found = [e for e in self.d.find_elements(self.By.XPATH, xpath) if e.is_displayed()]
        found += [
            e
            for e in self.d.find_elements(self.By.CSS_SELECTOR, f"[aria-label='number input for {label}']")
            if e.is_displayed()
        ]
        assert found, f"no visible field labelled {label!r}"
        return found[0]

    def type(self, label: str, value, enter: bool = False) -> None:
        el = self.field(label)
        el.click()
        el.send_keys(self.Keys.CONTROL, "a")
        el.send_keys(self.Keys.DELETE)
        el.send_keys(str(value))
        el.send_keys(self.Keys.ENTER if enter else self.Keys.TAB)

    def choose(self, label: str, value: str) -> None:
        """A dropdown: type the choice and click it in the list (Enter takes the first match, or a
        custom value where the dropdown allows one)."""
        el = self.field(label)
        el.click()
        el.send_keys(self.Keys.CONTROL, "a")
        el.send_keys(self.Keys.DELETE)
        el.send_keys(value)
        options = self.d.find_elements(self.By.CSS_SELECTOR, f"li[role='option'][aria-label='{value}']")
        shown = [o for o in options if o.is_displayed()]
        if shown:
            shown[0].click()
        else:
            el.send_keys(self.Keys.ENTER)
        el.send_keys(self.Keys.TAB)

    def click_text(self, text: str) -> None:
        xpath = f"//button[normalize-space()='{text}' or .//span[normalize-space()='{text}']]"
        button = next(e for e in self.d.find_elements(self.By.XPATH, xpath) if e.is_displayed())
        self.d.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
        button.click()

    def open_accordion(self, title: str) -> None:
        xpath = f"//button[contains(@class,'label-wrap') and starts-with(normalize-space(), '{title}')]"
        self.d.find_element(self.By.XPATH, xpath).click()

    def by_id(self, elem_id: str):
        return self.d.find_element(self.By.ID, elem_id)


@pytest.mark.skipif(NO_BROWSER is not None, reason=f"browser test: {NO_BROWSER}")
def test_board_trains_the_demo_with_kt_ft(board, browser, demo_assets):
    url, workdir, log_path = board
    page = Page(browser)
    browser.get(url)
    page.wait(lambda: "Model path" in page.text() and page.field("Model path"), 60, "the board's labels")

    page.choose("Model name", "Custom")
    page.type("Model path", demo_assets / "model")
    page.choose("Chat template", "qwen")
    page.type("Data dir", demo_assets / "data")
    page.choose("Dataset", "kt_demo")
    page.choose("Compute type", "fp32")
    page.type("Cutoff length", 64)
    page.type("Batch size", 2)
    page.type("Gradient accumulation", 1)
    page.type("Max samples", 16)
    page.open_accordion("Extra configurations")
    page.type("Extra arguments", json.dumps(EXTRA_ARGS))

    page.open_accordion("kt-ft")
    page.wait(lambda: page.by_id("kt_ft_use_kt").is_displayed(), 10, "the kt-ft fields")
    page.by_id("kt_ft_use_kt").find_element(page.By.TAG_NAME, "input").click()
    page.type("cpu_infer", 2)
    page.type("chunk_size", 128)

    # a rule no one has: kt-ft's message (file, key, value, choices) in the output box, nothing runs
    page.choose("kt_optimize_rule", "nope")
    page.click_text("Start")
    page.wait(
        lambda: "kt_optimize_rule='nope': no such file and no built-in rule" in page.text(), 30, "the error"
    )
    assert "training_args.yaml: kt_optimize_rule='nope'" in page.text()
    assert "built-in rules: deepseek_v2" in page.text()
    assert not list(workdir.glob("saves/**/training_args.yaml"))

    # the plan of a real rule, from config.json only
    page.choose("kt_optimize_rule", "qwen3_moe-torch")
    page.click_text("Plan (kt-ft rules plan)")
    plan = page.wait(
        lambda: "fits" in page.by_id("kt_ft_plan_box").text and page.by_id("kt_ft_plan_box").text,
        60,
        "the plan",
    )
    # as shown: markdown drops the backticks around the rule's name
    assert "rule qwen3_moe-torch: fits the budget" in plan and "qwen3_moe-torch.yaml" in plan

    page.click_text("Start")

    def started():
        assert "Failed." not in page.text(), "the run failed:\n" + page.text()[-3000:]
        return next(workdir.glob("saves/Custom/lora/*/trainer_log.jsonl"), None)

    trainer_log = page.wait(started, 90, "a run")

    def losses():
        rows = [json.loads(line) for line in trainer_log.read_text().splitlines() if line.strip()]
        found = [r["loss"] for r in rows if "loss" in r]
        return found if len(found) >= 3 else None

    losses = page.wait(losses, 120, "three logged losses")
    assert all(0 < loss < 20 for loss in losses), losses
    page.wait(
        lambda: "Finished." in page.text() and "'loss':" in page.text(), 60, "the board's finish and loss"
    )
    run_dir = trainer_log.parent
    recipe = (run_dir / "training_args.yaml").read_text()
    for line in ("use_kt: true", "kt_optimize_rule: qwen3_moe-torch", "cpu_infer: 2", "chunk_size: 128"):
        assert line in recipe, recipe
    assert (run_dir / "fused_expert_lora.safetensors").is_file()
