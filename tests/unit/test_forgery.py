"""Requests a web page could forge (issue 49, finding 4): a rebinding page's Host, another site's Origin, a body
a form or a text/plain fetch can send without a preflight. Each is refused before any route runs; clients
that are not browsers, and the server's own web page, are answered as before."""

from email.message import Message

import pytest

from reame.server.forgery import LOOPBACK_NAMES, allowed_hosts, forged, host_name
from tests.unit.test_server import Live

JSON = {"Content-Type": "application/json"}


def headers(**fields: str) -> Message:
    message = Message()
    for name, value in fields.items():
        message[name.replace("_", "-")] = value
    return message


@pytest.mark.parametrize("value, name", [("localhost:8080", "localhost"), ("LOCALHOST", "localhost"),
                                         ("[::1]:8080", "::1"), ("[::1]", "::1"), ("::1", "::1"),
                                         ("127.0.0.1:1", "127.0.0.1"), ("evil.example:80", "evil.example")])
def test_host_names_lose_their_port_and_brackets(value, name):
    assert host_name(value) == name


def test_a_loopback_server_answers_to_loopback_names_and_a_public_one_to_any_unless_told():
    assert allowed_hosts("127.0.0.1", ()) == LOOPBACK_NAMES
    assert allowed_hosts("127.0.0.2", ()) == LOOPBACK_NAMES | {"127.0.0.2"}
    assert allowed_hosts("::1", ()) == LOOPBACK_NAMES
    assert allowed_hosts("0.0.0.0", ()) is None and allowed_hosts("192.0.2.7", ()) is None
    assert allowed_hosts("127.0.0.1", ("reame.example.org",)) == {"reame.example.org", "127.0.0.1"}
    assert allowed_hosts("0.0.0.0", ("Reame.Example.org:443", " ")) == {"reame.example.org"}
    assert allowed_hosts("127.0.0.1", ("*",)) is None


def test_each_forgery_is_named_and_everything_else_passes():
    hosts = LOOPBACK_NAMES

    def code(method="POST", body=True, cors="", **fields):
        error = forged(method, headers(**fields), body, hosts, cors)
        return None if error is None else (error.status, error.code)

    assert code(Host="evil.example:8080", Content_Type="application/json") == (403, "host_not_allowed")
    assert code(Host="localhost:8080", Origin="http://evil.example", Content_Type="application/json") == \
        (403, "origin_not_allowed")
    assert code(Host="localhost:8080", Origin="null", Content_Type="application/json") == (403, "origin_not_allowed")
    assert code(Host="localhost:8080", Origin="http://localhost:9999", Content_Type="application/json") == \
        (403, "origin_not_allowed")  # another port is another origin: another local service's page
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        assert code(Host="localhost:8080", Content_Type=kind) == (415, "unsupported_media_type")
    assert code(Host="localhost:8080") == (415, "unsupported_media_type")  # a fetch of a Blob sends no type
    # What passes: a client that is not a browser, the server's own page, a configured CORS origin, no body.
    assert code(Host="localhost:8080", Content_Type="application/json; charset=utf-8") is None
    assert code(Host="127.0.0.1:8080", Origin="http://127.0.0.1:8080", Content_Type="application/json") is None
    assert code(cors="https://app.example", Host="localhost", Origin="https://app.example",
                Content_Type="application/json") is None
    assert code(cors="*", Host="localhost", Origin="https://any.example", Content_Type="application/json") is None
    assert code(Content_Type="application/json") is None  # no Host: HTTP/1.0, not a browser
    assert code(method="GET", body=False, Host="localhost") is None
    assert code(method="DELETE", body=False, Host="localhost") is None
    # An upload route takes a form's multipart body, from a client or the server's own page, not another page.
    upload = "multipart/form-data; boundary=x"
    assert forged("POST", headers(Host="localhost", Content_Type=upload), True, hosts, "", multipart=True) is None
    assert forged("POST", headers(Host="localhost", Origin="http://evil.example", Content_Type=upload), True, hosts,
                  "", multipart=True).code == "origin_not_allowed"
    assert forged("POST", headers(Host="localhost", Content_Type="text/plain"), True, hosts, "",
                  multipart=True).code == "unsupported_media_type"


def test_a_rebinding_page_and_a_cross_site_post_get_403_and_the_own_page_is_answered(live):
    own = f"127.0.0.1:{live.port}"
    body = {"prompt": "hi", "max_tokens": 1}
    status, answer = live.json("GET", "/v1/models", headers={"Host": f"evil.example:{live.port}"})
    assert status == 403 and answer["error"]["code"] == "host_not_allowed"
    status, answer = live.json("POST", "/v1/completions", body, {"Host": own, "Origin": "http://evil.example"})
    assert status == 403 and answer["error"]["code"] == "origin_not_allowed"
    response, data = live.request("POST", "/v1/completions", raw=b'{"prompt": "hi", "max_tokens": 1}',
                                  headers={"Content-Type": "text/plain;charset=UTF-8"})
    assert response.status == 415 and b"Content-Type: application/json" in data
    status, answer = live.json("POST", "/v1/completions", body, {"Host": own, "Origin": f"http://{own}"})
    assert status == 200 and answer["object"] == "text_completion"
    assert live.json("GET", "/health", headers={"Host": f"[::1]:{live.port}"})[0] == 200


def test_configured_names_are_answered(engine):
    server = Live(engine, allowed_hosts=("reame.example.org",))
    try:
        assert server.json("GET", "/v1/models", headers={"Host": "reame.example.org"})[0] == 200
        assert server.json("GET", "/v1/models", headers={"Host": "other.example.org"})[0] == 403
    finally:
        server.close()
