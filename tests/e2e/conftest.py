"""Browser test setup: Debian's Chromium (installed with apt when missing), the app in a subprocess, one page.

Playwright's own browser downloads are never used: Chromium is launched from /usr/bin/chromium. When it is
missing and we are root with apt-get, `apt-get install -y chromium` runs once (CI runs as root); the tests are
skipped, with the reason, only when apt cannot be used at all. Screenshots and the app log go to
$DECODING_LAB_E2E_ARTIFACTS (default: <tmp>/decoding-lab-e2e); set DECODING_LAB_SCREENSHOTS=docs/screenshots to
also refresh the README's screenshots (`make screenshots`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from tests.appserver import ROOT, running_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    # never treat the page as backgrounded (timer throttling, deferred drawing): the tests watch live updates
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
    "--disable-features=IntensiveWakeUpThrottling,CalculateNativeWinOcclusion",
]
VIEWPORT = {"width": 1400, "height": 1000}


def _apt_install_chromium() -> str:
    """Install Debian's chromium; returns "" on success, else apt's output tail."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:  # stale or missing package lists: update once and retry
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    return "" if result.returncode == 0 and CHROMIUM.exists() else (result.stdout + result.stderr)[-3000:]


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    if not shutil.which("apt-get"):
        pytest.skip("/usr/bin/chromium is missing and apt-get is not available to install Debian's chromium")
    if os.geteuid() != 0:
        pytest.skip("/usr/bin/chromium is missing; run as root (or `sudo apt-get install chromium`) to install it")
    error = _apt_install_chromium()
    if error:
        pytest.fail(f"apt-get install chromium failed:\n{error}")
    return CHROMIUM


@pytest.fixture(scope="session")
def artifacts() -> Path:
    default = Path(tempfile.gettempdir()) / "decoding-lab-e2e"
    path = Path(os.environ.get("DECODING_LAB_E2E_ARTIFACTS", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def screenshot(artifacts: Path):
    """save(page, name): a full-page PNG into the artifacts folder (and docs/screenshots when asked)."""
    readme_dir = os.environ.get("DECODING_LAB_SCREENSHOTS")

    def save(page, name: str) -> Path:
        path = artifacts / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        if readme_dir:
            target = (ROOT / readme_dir).resolve()
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target / path.name)
        return path

    return save


@pytest.fixture(scope="module")
def app_server(request, artifacts: Path):
    """`python app.py` for this module; a module's APP_ENV dict adds environment variables."""
    with running_app(artifacts, getattr(request.module, "APP_ENV", None)) as server:
        yield server


@pytest.fixture(scope="module")
def browser(chromium_path: Path):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium_path), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(browser, app_server):
    """One page for the module, so runs build on each other like a student's session."""
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(app_server.url)
    # Gradio renders after fetching its config, in pieces: the prompt and the Run button (drawn after it) visible
    page.get_by_label("Prompt", exact=True).wait_for()
    page.locator("#run-button").wait_for()
    yield page
    context.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.e2e_failed = report.failed


@pytest.fixture(autouse=True)
def screenshot_on_failure(request, artifacts: Path):
    """A failing browser test leaves `FAILED-<test>.png` in the artifacts folder."""
    yield
    if getattr(request.node, "e2e_failed", False) and "page" in request.fixturenames:
        page = request.getfixturevalue("page")
        page.screenshot(path=str(artifacts / f"FAILED-{request.node.name}.png"), full_page=True)
