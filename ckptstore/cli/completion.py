"""``ckptstore completion bash|zsh``: a shell completion script, made from the parser itself."""

from __future__ import annotations

import argparse

NAME = "completion"
HELP = "print a shell completion script (bash, zsh)"

_BASH_COMPLETION = r"""# bash completion for ckptstore
# zsh: run `autoload -U +X bashcompinit && bashcompinit` before sourcing this
_ckptstore() {
    local cur="${COMP_WORDS[COMP_CWORD]}" cmd="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${COMP_WORDS[i]}" in -*) ;; *) cmd="${COMP_WORDS[i]}"; break ;; esac
    done
    if [[ -z "$cmd" ]]; then
        COMPREPLY=($(compgen -W "%(commands)s %(common)s" -- "$cur"))
        return
    fi
    case "$cmd" in
%(cases)s
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts %(common)s" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}
complete -o filenames -F _ckptstore ckptstore
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``bash`` or ``zsh``."""
    parser.add_argument("shell", choices=("bash", "zsh"))


def completion_script(parser: argparse.ArgumentParser) -> str:
    """A completion script for ``parser``'s commands and options (bash; zsh through bashcompinit).

    Install: ``ckptstore completion bash > ~/.local/share/bash-completion/completions/ckptstore``
    or ``eval "$(ckptstore completion bash)"`` in your shell's rc file.
    """
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        opts = sorted(
            o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"
        )
        common = {"--json", "--storage-option", "--verbose"}
        opts = [o for o in opts if o not in common]
        cases.append(f'        {name}) local opts="{" ".join(opts)}" ;;')
    return _BASH_COMPLETION % {
        "commands": " ".join(sub.choices),
        "common": "--json --storage-option --verbose --help --version",
        "cases": "\n".join(cases),
    }


def run(args: argparse.Namespace) -> int:
    """Print the script (the same for bash and zsh) for the whole parser, ``args.parser``."""
    print(completion_script(args.parser), end="")
    return 0
