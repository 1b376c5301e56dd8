"""What both example spiders scrape from a product page (the demo site's and nginx's catalog share it)."""


def page_item(response) -> dict:
    """The product page as an item, with the proxy id the plugin leased for it (never its URL)."""
    return {
        "kind": "page",
        "url": response.url,
        "title": response.css("h1.title::text").get(),
        "price": response.css("span.price::text").get(),
        "proxy_id": response.meta.get("proxy_shard_proxy_id"),
    }
