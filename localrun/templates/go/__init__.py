"""Ollama's chat templates: Go's text/template language, rendered as Ollama renders them.

An Ollama Modelfile's TEMPLATE (and the `template` of Ollama's /api/create and /api/generate) is a Go
template: ``{{ .System }}``, ``{{ .Prompt }}``, ``{{ range .Messages }}{{ .Role }}...{{ end }}``,
``{{- if .Tools }}...{{ json .Function.Arguments }}``. This package parses that language (actions with
``{{-`` / ``-}}`` trim markers, comments, pipelines with ``|``, parenthesized pipelines, variables
declared with ``:=`` and set with ``=``, if / else if / else, range (over lists, maps in key order,
integers; ``$i, $x :=``; break and continue), with, and Go's built-in functions plus Ollama's
``json``, ``currentDate``, ``yesterdayDate`` and ``toTypeScriptType``) and renders a chat the way
Ollama's ``template.Execute`` does (ollama.py: the values a chat gives a template, and the two ways
of rendering it).

Values print as Go prints them: lists of tools, tool-call arguments and tool properties as JSON
(Go's encoding: keys of maps sorted, ``<``, ``>`` and ``&`` escaped), booleans as true / false, a
missing map key as ``<no value>``. ``define``, ``template`` and ``block`` are refused (400): Ollama's
templates do not use them. Nothing here runs code a template names: the language has no access to
Python objects, only to the values given to it; the caller bounds time and output size.

The package: ``values`` (Go's values and how they print), ``parser`` (recognising, lexing, parsing),
``funcs`` (the functions a template calls), ``executor`` (rendering a tree) and ``ollama`` (Ollama's
Execute over a chat). Its public names are re-exported here.
"""

from __future__ import annotations

from localrun.templates.go.executor import execute
from localrun.templates.go.ollama import OllamaTemplate, compile_ollama, render_ollama
from localrun.templates.go.parser import GoTemplateError, is_go_template, parse

__all__ = ["GoTemplateError", "OllamaTemplate", "compile_ollama", "execute", "is_go_template", "parse",
           "render_ollama"]
