"""The test and soak clients of vLLM's OpenAI server (support/openai_server.py).

A short soak in CI once counted one ``APIConnectionError`` with every request of the
server's log answered: a request sent on an idle connection the server was closing at
that moment (its keep-alive ran out while the clients waited for a fault). The clients
let an idle connection go first.
"""

from support.openai_server import client_limits


def test_an_idle_connection_is_let_go_before_vllm_s_keep_alive_closes_it():
    import vllm.envs as envs

    assert 0 < client_limits().keepalive_expiry < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
