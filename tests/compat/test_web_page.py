"""The built-in web page in a real browser (Debian's chromium and chromium-driver, driven by selenium):
against a live SmolLM2 server with an API key, a FakeBackend server whose answer is HTML, one of two
FakeBackend models, and a FakeBackend server running a batch uploaded from the page.
Screenshots go to build/test-artifacts/ (REAME_TEST_ARTIFACTS overrides it)."""

import json
import os
import threading
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from reame.engine import Engine
from reame.server.models import ModelPool, ServedModel
from tests.fakes.backend import FakeBackend, reply_rule
from tests.live_server import smollm2_server as serve_smollm2
from tests.unit.test_batches import BatchServer, chat_line, jsonl
from tests.unit.test_server import Live

ROOT = Path(__file__).resolve().parents[2]
KEY = "web-page-key"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("REAME_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))
HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold</b>'


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), \
        "the browser tests need Debian's chromium and chromium-driver (.ci/run installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def smollm2_server(native_libraries, smollm2_path):
    with serve_smollm2(smollm2_path, KEY, parallel=2) as base:
        yield base


def wait(driver, condition, timeout_s=120):
    return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(lambda _: condition())


def screenshot(driver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def send(driver, prompt: str, max_tokens: int, temperature: float = 0) -> None:
    for field, value in (("max_tokens", max_tokens), ("temperature", temperature)):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(str(value))
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()


def unlock(driver, base: str) -> None:
    """Open the page of a server with a key, and give it the key once the page asks for it."""
    driver.get(base + "/")
    wait(driver, lambda: driver.find_element(By.ID, "keybox").is_displayed())  # /health said a key is needed
    driver.find_element(By.ID, "key").send_keys(KEY)
    driver.find_element(By.ID, "usekey").click()
    wait(driver, lambda: driver.find_element(By.ID, "model").text == "smollm2-135m")


def last_answer(driver):
    answers = driver.find_elements(By.CSS_SELECTOR, "#log .msg.assistant")
    return answers[-1] if answers else None


def busy_slots(base: str) -> float:
    request = urllib.request.Request(base + "/stats", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        samples = json.loads(response.read())["samples"]
    return sum(s["value"] for s in samples if s["name"] == "reame_busy_slots")


def test_chat_streams_an_answer_with_its_stats_and_the_dashboard_charts_it(browser, smollm2_server):
    unlock(browser, smollm2_server)
    send(browser, "Name three colours of the rainbow.", 24)
    wait(browser, lambda: "tokens" in last_answer(browser).find_element(By.CLASS_NAME, "stats").text)
    answer = last_answer(browser)
    assert answer.find_element(By.CLASS_NAME, "text").text.strip()
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert "first token" in stats and "reused from cache" in stats
    screenshot(browser, "web-chat")

    browser.find_element(By.ID, "tab-dashboard").click()
    # A point per poll: the answer's tokens show up as a rate above zero in the tokens/s chart.
    wait(browser, lambda: browser.find_element(By.ID, "c-answers").text.startswith("1 ·"))
    wait(browser, lambda: any(float(point.split(",")[1]) < 100 for line in
                              browser.find_elements(By.CSS_SELECTOR, "#ch-rate polyline")
                              for point in line.get_attribute("points").split()), timeout_s=30)
    screenshot(browser, "web-dashboard")
    assert console_errors(browser) == []


def test_the_stop_button_cancels_the_generation(browser, smollm2_server):
    unlock(browser, smollm2_server)
    send(browser, "Write a very long story about a lighthouse keeper.", 1500, temperature=0.7)
    wait(browser, lambda: last_answer(browser).find_element(By.CLASS_NAME, "text").text.strip())
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda: last_answer(browser).find_element(By.CLASS_NAME, "stats").text == "stopped")
    wait(browser, lambda: busy_slots(smollm2_server) == 0, timeout_s=30)  # the server freed the slot
    assert browser.find_element(By.ID, "send").is_enabled()
    assert console_errors(browser) == []


@pytest.fixture
def html_server():
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2, rule=reply_rule(HOSTILE))) as engine:
        server = Live(engine)
        yield f"http://127.0.0.1:{server.port}"
        server.close()


def test_model_output_with_html_in_it_stays_text(browser, html_server):
    browser.get(html_server + "/")
    send(browser, "Say something dangerous.", 200)
    wait(browser, lambda: "tokens" in last_answer(browser).find_element(By.CLASS_NAME, "stats").text, 30)
    answer = last_answer(browser).find_element(By.CLASS_NAME, "text")
    assert answer.text == HOSTILE  # shown as written, not parsed
    assert browser.find_elements(By.CSS_SELECTOR, "#log b, #log img, #log script") == []
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_element(By.ID, "keybox").is_displayed() is False  # no key on this server
    assert console_errors(browser) == []


def test_the_page_fits_a_phone_sized_screen(browser, html_server):
    browser.set_window_size(390, 844)
    try:
        browser.get(html_server + "/")
        send(browser, "Hello.", 50)
        wait(browser, lambda: "tokens" in last_answer(browser).find_element(By.CLASS_NAME, "stats").text, 30)
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        screenshot(browser, "web-phone")
    finally:
        browser.set_window_size(1200, 900)


@pytest.fixture
def two_model_server():
    """A FakeBackend server of two models, "small" and "coder", each answering with its own name."""
    def load(model: ServedModel) -> Engine:
        return Engine(FakeBackend(n_ctx=1024, rule=reply_rule(f"I am {model.name}."))).start()
    models = ModelPool([ServedModel("small"), ServedModel("coder")], load, max_loaded=1)
    server = Live(None, models)
    yield f"http://127.0.0.1:{server.port}"
    server.close()
    models.close()


def test_a_server_of_several_models_lets_the_chat_choose_one(browser, two_model_server):
    browser.get(two_model_server + "/")
    choice = browser.find_element(By.ID, "models")
    wait(browser, lambda: choice.is_displayed(), 30)
    assert [option.text for option in choice.find_elements(By.TAG_NAME, "option")] == ["small", "coder"]
    assert not browser.find_element(By.ID, "model").is_displayed()
    Select(choice).select_by_value("coder")
    send(browser, "Who are you?", 20)
    wait(browser, lambda: "tokens" in last_answer(browser).find_element(By.CLASS_NAME, "stats").text, 30)
    assert last_answer(browser).find_element(By.CLASS_NAME, "text").text == "I am coder."
    Select(choice).select_by_value("small")
    send(browser, "And now?", 20)
    wait(browser, lambda: last_answer(browser).find_element(By.CLASS_NAME, "text").text == "I am small.", 30)
    assert console_errors(browser) == []


@pytest.fixture
def batch_server(tmp_path):
    """A FakeBackend server with the Batch API whose answers to a prompt saying HOLD wait for the test."""
    gate = threading.Event()
    answer = reply_rule("ok")

    def rule(history):
        if b"HOLD" in bytes(token & 0xFF for token in history):
            gate.wait(60)
        return answer(history)
    with Engine(FakeBackend(n_ctx=1024, n_seq_max=2, rule=rule)) as engine:
        server = BatchServer(engine, tmp_path / "state")
        server.gate = gate
        yield server
        gate.set()
        server.close()


def test_a_batch_runs_from_the_page_with_its_progress_estimate_and_answers(browser, batch_server, tmp_path):
    lines = [chat_line("first", "a one"), chat_line("second", "a two"), chat_line("held", "b HOLD")]
    upload = tmp_path / "tickets.jsonl"
    upload.write_bytes(jsonl(lines))
    browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    browser.get(f"http://127.0.0.1:{batch_server.port}/")
    browser.find_element(By.ID, "tab-batches").click()
    wait(browser, lambda: "No batches yet" in browser.find_element(By.ID, "batch-list").text, 30)
    browser.find_element(By.ID, "batch-file").send_keys(str(upload))
    browser.find_element(By.ID, "batch-run").click()
    wait(browser, lambda: "Started batch_" in browser.find_element(By.ID, "batch-note").text, 30)
    # A card in progress is drawn anew at each poll: read it whole in the page, not through a kept element.
    card = lambda: browser.execute_script(  # noqa: E731
        "const card = document.querySelector('#batch-list .batch');"
        "return card && [card.innerText, card.querySelector('progress').value];")
    # Two lines answered, the third held: the bar, the count and an estimate of the time left.
    wait(browser, lambda: card() and "2 of 3 answered · about" in card()[0], 30)
    text, value = card()
    assert value == 2 and "in progress" in text
    screenshot(browser, "web-batches")
    batch_server.gate.set()
    wait(browser, lambda: "completed" in card()[0], 30)
    assert "3 of 3 answered" in card()[0] and "left" not in card()[0] and card()[1] == 3
    browser.find_element(By.CSS_SELECTOR, "#batch-list .batch .download-output").click()
    [batch] = batch_server.json("GET", "/v1/batches")[1]["data"]
    saved = tmp_path / f"{batch['id']}_output.jsonl"
    wait(browser, saved.exists, 30)
    assert [record["custom_id"] for record in map(json.loads, saved.read_text().splitlines())] == \
        ["first", "second", "held"]
    assert saved.read_bytes() == batch_server.request("GET", f"/v1/files/{batch['output_file_id']}/content")[1]
    assert console_errors(browser) == []


def test_the_batches_tab_says_when_the_server_has_no_batch_api(browser, html_server):
    browser.get(html_server + "/")
    browser.find_element(By.ID, "tab-batches").click()
    wait(browser, lambda: "The Batch API is off" in browser.find_element(By.ID, "batch-note").text, 30)
