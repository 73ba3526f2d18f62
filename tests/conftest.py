"""Shared fixtures."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEBTEXT = os.path.join(REPO, "data", "webtext")


@pytest.fixture(scope="session")
def webtext_data():
    """The embedded default data (data/webtext/), built once if missing (~20-50 s); returns its directory."""
    if not os.path.exists(os.path.join(WEBTEXT, "webtext_text_document.idx")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_default_data.py")], cwd=REPO,
                       check=True, timeout=600)
    return WEBTEXT
