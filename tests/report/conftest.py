import numpy as np
import pytest


@pytest.fixture(scope="module")
def records(shakespeare):
    """Ten TinyShakespeare documents of several lengths (some of one window, some of several) in three groups of
    unequal size by their "source" field."""
    text = shakespeare.read_text()
    sources = ("wiki", "books", "code")
    lengths = [90, 400, 150, 260, 30, 500, 120, 210, 75, 330]
    starts = np.cumsum([0] + lengths[:-1]) + 2000
    return [{"id": f"doc-{i}", "source": sources[i % 3] if i < 8 else "wiki", "text": text[s:s + n]}
            for i, (s, n) in enumerate(zip(starts, lengths))]
