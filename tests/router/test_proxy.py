"""Which relayed SSE events count as "the client has seen a token" (until then a failed stream
may be retried elsewhere), on events written by hand in the shapes tandem's server sends."""
from __future__ import annotations

import pytest

from tandem.router.proxy import is_visible

CHAT_ROLE = ('data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
             '{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
CHAT_TEXT = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
CMPL_EMPTY = 'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'
CMPL_TEXT = 'data: {"id":"c","choices":[{"index":0,"text":" the","finish_reason":null}]}\n\n'
CMPL_FINISH = 'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
USAGE = 'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
ERROR = 'data: {"error":{"message":"boom","type":"internal_server_error","param":null,"code":"x"}}\n\n'


@pytest.mark.parametrize("event, visible", [
    (CHAT_ROLE, False),
    (CMPL_EMPTY, False),
    (": keep-alive\n\n", False),
    (CHAT_TEXT, True),
    (CMPL_TEXT, True),
    (CMPL_FINISH, True),
    (USAGE, True),
    (ERROR, True),
    ("data: [DONE]\n\n", True),
    ("event: message\ndata: not json\n\n", True),
])
def test_visible_events(event, visible):
    assert is_visible(event) is visible
