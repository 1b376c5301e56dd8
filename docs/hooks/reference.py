"""mkdocs hook: fills the reference pages from the tables in ``scrapy_proxy_shard.reference``.

A page line ``<!-- reference: NAME -->`` is replaced by ``scrapy_proxy_shard.reference.markdown.render(NAME)``
(settings, stats, metrics, meta) while the site builds, so the pages say what the installed code
says. An unknown NAME stops the build.
"""

from __future__ import annotations

import re

from mkdocs.exceptions import PluginError

from scrapy_proxy_shard.reference.markdown import render

MARKER = re.compile(r"^<!-- reference: ([a-z_]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        try:
            return render(match.group(1))
        except KeyError as exc:
            raise PluginError(f"{page.file.src_path}: {exc.args[0]}") from None

    return MARKER.sub(replace, markdown)
