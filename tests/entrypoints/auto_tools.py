"""Fixtures of the Responses and Messages tests: ``server`` and ``model_name`` over ``auto_tool_server`` (the main
test server's twin with ``--enable-auto-tool-choice``: "auto", the default with tools, needs it on every API, as
vLLM's rule). A test module imports them to use that server instead of the main one."""

import pytest


@pytest.fixture(scope="module")
def server(auto_tool_server):
    """"auto" tool calls need --enable-auto-tool-choice (vLLM's rule, on every API): the main server's twin with it."""
    return auto_tool_server


@pytest.fixture(scope="module")
def model_name(server):
    return server.llm_model_name
