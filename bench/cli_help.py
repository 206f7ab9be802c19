"""The benches' `--help`: argparse's defaults shown after each option, except a default of None, whose option's help
says what leaving it unset means ("unset: a temporary directory") and would otherwise end in "(default: None)"."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`argparse.ArgumentDefaultsHelpFormatter` without the "(default: None)" suffix."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)
