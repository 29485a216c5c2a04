"""The tests' name for ``ucm_testing.throttle``: a bandwidth-limiting TCP
proxy in front of a real server."""

from ucm_testing.throttle import CHUNK, ThrottleProxy

__all__ = ["CHUNK", "ThrottleProxy"]
