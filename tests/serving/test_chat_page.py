"""The chat page at GET / in a real headless Chromium (Debian's package) against a real server: the page is loaded,
a message typed and sent with a real mouse click, and the reply read from the DOM once its stream has ended. It
must equal what the server answers for the same chat request outside the browser (greedy), turn after turn; the
requests the page sent are read back from inside it. A screenshot is kept under test-artifacts/ (git-ignored)."""
import os
import shutil

import pytest

from tests.helpers import REPO
from tests.serving.browser import HeadlessChromium
from tests.serving.conftest import start_server

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None,
                                reason="needs Debian's chromium (/usr/bin/chromium; .ci/run installs it)")

API_KEY = "page-key"
MAX_TOKENS = 12
ARTIFACTS = os.path.join(REPO, "test-artifacts")
REPLY = "document.querySelectorAll('.message.assistant')"
RECORD_REQUESTS = """window.sentBodies = [];
const realFetch = window.fetch;
window.fetch = (url, init) => {
  if (url === '/v1/chat/completions') window.sentBodies.push(JSON.parse(init.body));
  return realFetch(url, init);
};"""


@pytest.fixture(scope="module")
def keyed_server(checkpoint):
    with start_server(checkpoint, ["--max-batch-size", "4"], api_key=API_KEY) as running:
        yield running


def set_field(page, selector, text):
    """Empty an input, then type `text` into it and leave it (the page reads fields on change)."""
    page.evaluate(f"document.querySelector('{selector}').value = ''")
    page.type_into(selector, text)
    page.evaluate(f"document.querySelector('{selector}').blur()")


def send(page, text, turn):
    """Type and send one message; return the state and text of the reply to it once it has ended."""
    page.type_into("#message", text)
    page.click("#send")
    page.wait_for(f"{REPLY}.length > {turn} && {REPLY}[{turn}].dataset.state !== 'streaming'")
    return page.evaluate(f"[{REPLY}[{turn}].dataset.state, {REPLY}[{turn}].textContent]")


def greedy_reply(server, messages):
    status, answer = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0})
    assert status == 200, answer
    return answer["choices"][0]["message"]["content"]


def test_chat_page_streams_the_servers_greedy_reply_in_chromium(keyed_server, checkpoint, tmp_path):
    with HeadlessChromium(tmp_path / "profile") as browser:
        page = browser.open(keyed_server.url + "/")
        page.wait_for("document.readyState === 'complete' && document.querySelector('#send') !== null")
        page.evaluate(RECORD_REQUESTS)

        # Without the key: the server's 401 message is shown on the reply, and the turn is not kept.
        state, text = send(page, "Hello", 0)
        assert state == "error" and "API key" in text, text

        set_field(page, "#api-key", API_KEY)          # its change event reloads the model's name, now allowed
        set_field(page, "#max-tokens", str(MAX_TOKENS))
        set_field(page, "#temperature", "0")
        page.wait_for("document.querySelector('#model-name').textContent === "
                      f"'{os.path.basename(checkpoint.path)}'")

        first = "Tell me about the weather"
        state, text = send(page, first, 1)
        expected = greedy_reply(keyed_server, [{"role": "user", "content": first}])
        assert state == "done" and expected and text == expected

        second = "And tomorrow?"
        state, again = send(page, second, 2)
        conversation = [{"role": "user", "content": first}, {"role": "assistant", "content": expected},
                        {"role": "user", "content": second}]
        assert state == "done" and again == greedy_reply(keyed_server, conversation)

        sent = page.evaluate("window.sentBodies")
        assert [body["stream"] for body in sent] == [True, True, True]
        assert sent[2] == {"messages": conversation, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0}

        os.makedirs(ARTIFACTS, exist_ok=True)
        shot = page.screenshot(os.path.join(ARTIFACTS, "chat_page.png"))
    with open(shot, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")
