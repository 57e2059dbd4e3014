"""Shared set-up for the single-card end-to-end tests on vLLM's CPU platform."""

from kvoffload_hal.demo.inprocess import set_inprocess_env

set_inprocess_env()  # before vLLM reads its environment
