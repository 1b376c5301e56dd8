"""Undo ``Content-Encoding`` on a response body, for ban detection that runs before Scrapy does it.

The ban-detection middleware sits at priority 620, closer to the downloader than Scrapy's
``HttpCompressionMiddleware`` (590), so its ``process_response`` sees the body exactly as the server
sent it: gzip, deflate, br or zstd. Content checks (required CSS, body size) must look at the page a
spider would see, so this module decodes a copy. It never raises on a bad body: a body that cannot
be decoded returns ``None`` and the caller skips its content checks (``HttpCompressionMiddleware``
reports the broken body itself, later). Decoding is bounded by ``max_size`` like Scrapy's, so a
decompression bomb costs at most that much memory here as well.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable, Iterable
from io import BytesIO
from typing import Any

try:  # Scrapy asks for br only when one of these is installed.
    import brotli
except ImportError:  # pragma: no cover - depends on the environment
    try:
        import brotlicffi as brotli
    except ImportError:
        brotli = None

_zstandard: Any = None
_stdlib_zstd: Any = None
try:
    import zstandard as _zstandard
except ImportError:
    # Python 3.14's module, else the backport Scrapy >= 2.14 depends on.
    for _module in ("compression.zstd", "backports.zstd"):
        try:
            _stdlib_zstd = importlib.import_module(_module)
            break
        except ImportError:
            continue

__all__ = ["content_encodings", "decode_body", "supported_encodings"]

_CHUNK = 64 * 1024


class _TooLarge(Exception):
    """The decoded body grew past ``max_size``; treated like any other undecodable body."""


def content_encodings(values: Iterable[bytes | str]) -> list[str]:
    """Flatten ``Content-Encoding`` header values (several headers, comma lists) in the order applied.

    ``identity`` and empty items are dropped: they mean "not encoded".
    """
    out: list[str] = []
    for value in values:
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        for item in text.split(","):
            item = item.strip().lower()
            if item and item != "identity":
                out.append(item)
    return out


def decode_body(body: bytes, encodings: Iterable[bytes | str], *, max_size: int = 0) -> bytes | None:
    """The body with every listed encoding undone (last applied, first undone), or ``None``.

    ``None`` means the body cannot be decoded: an unknown encoding, a codec that is not installed,
    corrupt data, or more than ``max_size`` decoded bytes (``0`` = no limit).
    """
    for encoding in reversed(content_encodings(encodings)):
        decoder = _DECODERS.get(encoding)
        if decoder is None:
            return None
        try:
            body = decoder(body, max_size)
        # Each codec library raises its own error types (zlib.error, brotli.error, ZstdError,
        # OSError, EOFError...): whatever it is, the answer is "cannot tell", never a crash.
        except Exception:
            return None
    return body


def supported_encodings() -> tuple[str, ...]:
    """Content codings this environment can decode (br and zstd depend on optional packages)."""
    return tuple(_DECODERS)


# --- codecs ------------------------------------------------------------------------------------

def _check(size: int, max_size: int) -> None:
    if max_size and size > max_size:
        raise _TooLarge(size)


def _zlib_stream(data: bytes, wbits: int, max_size: int) -> bytes:
    """Inflate one zlib/gzip/raw-deflate stream in bounded chunks; gzip may hold several members."""
    out = BytesIO()
    size = 0
    while data:
        decompressor = zlib.decompressobj(wbits)
        chunk = decompressor.decompress(data, _CHUNK)
        while chunk:
            size += len(chunk)
            _check(size, max_size)
            out.write(chunk)
            if decompressor.eof or (not decompressor.unconsumed_tail and len(chunk) < _CHUNK):
                break
            # A full chunk may leave output pending inside zlib even when all input is consumed.
            chunk = decompressor.decompress(decompressor.unconsumed_tail, _CHUNK)
        if not decompressor.eof:
            if size == 0:
                raise zlib.error("truncated stream with no data")
            break  # truncated: keep what was decoded, as Scrapy's gunzip does
        data = decompressor.unused_data
        if wbits != 16 + zlib.MAX_WBITS or not data.startswith(b"\x1f\x8b"):
            break  # only gzip concatenates members; trailing garbage is ignored
    return out.getvalue()


def _gunzip(data: bytes, max_size: int) -> bytes:
    return _zlib_stream(data, 16 + zlib.MAX_WBITS, max_size)


def _inflate(data: bytes, max_size: int) -> bytes:
    try:
        return _zlib_stream(data, zlib.MAX_WBITS, max_size)
    except zlib.error:
        # Some servers (notably IIS) send raw deflate without the zlib header.
        return _zlib_stream(data, -zlib.MAX_WBITS, max_size)


def _unbrotli(data: bytes, max_size: int) -> bytes:
    decompressor = brotli.Decompressor()
    try:
        chunk = decompressor.process(data, output_buffer_limit=_CHUNK)
    except TypeError:  # brotli < 1.2 has no output limit: decode at once, then check the size
        decoded = brotli.decompress(data)
        _check(len(decoded), max_size)
        return decoded
    out = BytesIO()
    size = 0
    while chunk:
        size += len(chunk)
        _check(size, max_size)
        out.write(chunk)
        if decompressor.is_finished():
            break
        chunk = decompressor.process(b"", output_buffer_limit=_CHUNK)
    return out.getvalue()


def _unzstd(data: bytes, max_size: int) -> bytes:
    if _zstandard is not None:
        reader = _zstandard.ZstdDecompressor().stream_reader(BytesIO(data), read_across_frames=True)
    else:
        reader = _stdlib_zstd.ZstdFile(BytesIO(data))
    out = BytesIO()
    size = 0
    with reader:
        while chunk := reader.read(_CHUNK):
            size += len(chunk)
            _check(size, max_size)
            out.write(chunk)
    return out.getvalue()


_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {"gzip": _gunzip, "x-gzip": _gunzip, "deflate": _inflate}
if brotli is not None:
    _DECODERS["br"] = _unbrotli
if _zstandard is not None or _stdlib_zstd is not None:
    _DECODERS["zstd"] = _unzstd
