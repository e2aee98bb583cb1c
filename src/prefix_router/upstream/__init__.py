"""The only HTTP client of the router: pooled HTTP/1.1 connections to backends."""
