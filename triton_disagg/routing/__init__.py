"""Which server serves a request: router, pools, discovery, metric scraping."""
