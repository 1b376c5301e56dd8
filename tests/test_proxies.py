import pytest

from scrapy_proxy_shard.engine.proxies import (
    exit_key,
    make_proxy,
    mask,
    parse_proxy,
    proxy_id,
    send_url,
    split_credentials,
)
from scrapy_proxy_shard.exceptions import ProxyURLError


@pytest.mark.parametrize(
    ("entry", "canonical"),
    [
        ("1.2.3.4:8080", "http://1.2.3.4:8080"),
        ("HTTP://Proxy.Example.com:3128", "http://proxy.example.com:3128"),
        ("https://u:p@h.example:443", "https://u:p@h.example:443"),
        ("user:pass@10.0.0.1:80", "http://user:pass@10.0.0.1:80"),
        ("http://u:p%40ss%3A@h.example:1", "http://u:p%40ss%3A@h.example:1"),  # encoded kept intact
        ("gw.example:7000:cust-123:s3cr@t", "http://cust-123:s3cr%40t@gw.example:7000"),  # provider format
        ("http://[::1]:8080", "http://[::1]:8080"),
        ("  http://h.example:1/  ", "http://h.example:1"),
    ],
)
def test_parse_proxy_canonical_forms(entry, canonical):
    assert parse_proxy(entry) == canonical


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("", "empty"),
        ("socks5://h.example:1080", "unsupported scheme"),
        ("http://h.example", "missing port"),
        ("http://h.example:0", "out of range"),
        ("http://h.example:70000", "out of range"),
        ("http://h.example:abc", "port is not a number"),
        ("http://300.1.1.1:80", "invalid IPv4"),
        ("http://bad_host!:80", "invalid host"),
        ("http://h.example:80/path", "no path"),
        ("http://:pw@h.example:80", "empty user name"),
        ("http://h .example:80", "whitespace"),
    ],
)
def test_parse_proxy_rejects_with_named_problem(entry, problem):
    with pytest.raises(ProxyURLError, match=problem):
        parse_proxy(entry)


def test_errors_never_show_passwords():
    with pytest.raises(ProxyURLError) as info:
        parse_proxy("socks5://alice:TopSecret@h.example:1080")
    assert "TopSecret" not in str(info.value)
    assert "alice" not in str(info.value)


def test_mask_hides_user_and_password_in_every_form():
    assert mask("http://alice:TopSecret@h:1") == "http://***:***@h:1"
    assert mask("http://token@h:1") == "http://***@h:1"
    assert mask("h.example:1:alice:TopSecret") == "h.example:1:***:***"
    assert mask("http://h:1") == "http://h:1"
    assert "TopSecret" not in repr(make_proxy("http://alice:TopSecret@h.example:1"))


def test_ids_are_stable_short_and_credential_free():
    url = parse_proxy("http://alice:TopSecret@h.example:1")
    assert proxy_id(url) == proxy_id(parse_proxy("http://alice:TopSecret@H.EXAMPLE:1"))
    assert len(proxy_id(url)) == 16
    assert proxy_id(url) != proxy_id(parse_proxy("http://alice:TopSecret@h.example:2"))
    assert "TopSecret" not in exit_key(url) and "alice" not in exit_key(url)


@pytest.mark.parametrize(("a", "b"), [
    ("http://u:old@10.0.0.1:3128", "http://u:new@10.0.0.1:3128"),  # a password rotation
    ("http://u:p@10.0.0.1:3128", "https://u:p@10.0.0.1:3128"),  # the two spellings of one host:port
    ("10.0.0.1:3128", "http://alice:pw@10.0.0.1:3128"),  # with and without credentials
    ("10.0.0.1:3128:alice:pw", "HTTPS://Bob:x@10.0.0.1:3128"),  # provider form, other case
    ("http://Proxy.Example.COM:8080", "proxy.example.com:8080"),
    ("http://[2001:DB8:0:0:0:0:0:1]:80", "https://u:p@[2001:db8::1]:80"),  # IPv6 spellings
    ("http://[::ffff:10.0.0.1]:3128", "http://10.0.0.1:3128"),  # IPv4-mapped IPv6 is the IPv4 address
    ("gw.example:7777:user-session-abc:old#session=abc", "http://user-session-abc:new@gw.example:7777#session=abc"),
])
def test_one_exit_is_one_id_whatever_the_spelling(a, b):
    assert exit_key(parse_proxy(a)) == exit_key(parse_proxy(b))
    assert make_proxy(a).id == make_proxy(b).id


@pytest.mark.parametrize(("a", "b"), [
    ("http://10.0.0.1:3128", "http://10.0.0.1:3129"),
    ("http://10.0.0.1:3128", "http://10.0.0.2:3128"),
    ("http://[::1]:80", "http://[::2]:80"),
    # gateway sessions are distinct exits only when declared; the default is one exit per host:port
    ("http://user-session-abc:pw@gw.example:7777#session=abc", "http://user-session-def:pw@gw.example:7777#session=def"),
    ("http://user-session-abc:pw@gw.example:7777#session=abc", "http://user-session-abc:pw@gw.example:7777"),
])
def test_other_exits_have_other_ids(a, b):
    assert make_proxy(a).id != make_proxy(b).id


def test_undeclared_gateway_sessions_are_one_exit():
    a = make_proxy("http://user-session-abc:pw@gw.example:7777")
    b = make_proxy("http://user-session-def:pw@gw.example:7777")
    assert a.id == b.id and a.exit == "gw.example:7777"


def test_declared_session_is_identity_not_address():
    url = parse_proxy("gw.example:7777:user-session-abc:s3cret#session=abc")
    assert url == "http://user-session-abc:s3cret@gw.example:7777#session=abc"
    assert exit_key(url) == "gw.example:7777#abc"
    assert send_url(url) == "http://user-session-abc:s3cret@gw.example:7777"
    assert mask(url) == "http://***:***@gw.example:7777#session=abc"
    assert parse_proxy("gw.example:7777:user:pa#ss") == "http://user:pa%23ss@gw.example:7777"  # '#' in a password


@pytest.mark.parametrize("entry", ["http://u:p@h.example:1#session=", "http://u:p@h.example:1#session=a b",
                                   "http://u:p@h.example:1#session=-x", "http://u:TopSecret@h.example:1#session=a@b"])
def test_bad_session_is_one_clear_line(entry):
    with pytest.raises(ProxyURLError) as info:
        parse_proxy(entry)
    assert "TopSecret" not in str(info.value)
    assert "session" in str(info.value) or "whitespace" in str(info.value)


def test_invalid_ipv6_is_named():
    with pytest.raises(ProxyURLError, match="invalid IPv6"):
        parse_proxy("http://[2001:db8::g]:80")


def test_split_credentials_decodes_for_proxy_authorization():
    assert split_credentials("http://u:p%40ss@h.example:1") == ("http://h.example:1", "u", "p@ss")
    assert split_credentials("http://h.example:1") == ("http://h.example:1", None, None)


def test_proxy_type_tag_is_validated():
    assert make_proxy("h.example:1", {"type": "residential"}).tags == {"type": "residential"}
    with pytest.raises(ProxyURLError, match="unknown type 'cheap'"):
        make_proxy("h.example:1", {"type": "cheap"})


@pytest.mark.parametrize(("text", "shown"), [
    ("redis://h:6379/0?password=TopSecret", "redis://h:6379/0?password=***"),
    ("redis://h/0?db=1&password=TopSecret&username=alice", "redis://h/0?db=***&password=***&username=***"),
    ("unix:///run/redis.sock?password=TopSecret", "unix:///run/redis.sock?password=***"),
    ("http://alice:TopSecret", "http://***:***"),                  # credentials with no host
    ("alice:TopSecret", "***:***"),
    ("h.example:1:alice", "h.example:1:***"),                      # host:port:user
    ("http://alice:Top/Se?cr#et@h:1", "http://***:***@h:1"),       # raw '/', '?', '#' in a password
    ("h.example:1:alice:Top/Secret?x", "h.example:1:***:***"),
    ("[::1]:8080:alice:TopSecret", "[::1]:8080:***:***"),
    (b"redis://:TopSecret@h:1", "redis://***:***@h:1"),
    (12345, "<int>"),
])
def test_mask_hides_every_credential_spelling(text, shown):
    assert mask(text) == shown


def test_host_port_user_without_password_says_what_is_missing():
    with pytest.raises(ProxyURLError, match="host:port:user:pass needs both a user name and a password") as info:
        parse_proxy("1.2.3.4:3128:useronly")
    assert "useronly" not in str(info.value) and "1.2.3.4:3128" in str(info.value)
