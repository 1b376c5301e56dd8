import pytest

from scrapy_proxy_shard.engine.proxies import make_proxy, mask, parse_proxy, proxy_id, split_credentials
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
    assert proxy_id(url) != proxy_id(parse_proxy("http://bob:TopSecret@h.example:1"))


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
