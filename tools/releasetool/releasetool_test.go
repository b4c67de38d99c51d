package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestBreakingEntries(t *testing.T) {
	changelog := "# Changelog\n\n## [Unreleased]\n\n### Added\n\n- a\n\n### Breaking\n\n- `idem.X` is gone\n\n## [0.1.0] - 2026-12-01\n\n### Breaking\n\n- old\n"
	if got := breakingEntries(changelog); !slices.Equal(got, []string{"- `idem.X` is gone"}) {
		t.Errorf("breakingEntries = %q", got)
	}
	released := "# Changelog\n\n## [Unreleased]\n\n### Added\n\n- a\n\n## [0.1.0] - 2026-12-01\n\n### Breaking\n\n- old\n"
	if got := breakingEntries(released); len(got) != 0 {
		t.Errorf("an earlier release's Breaking entries count: %q", got)
	}
}

func TestLineDiff(t *testing.T) {
	added, removed := lineDiff([]byte("a\nb\nc\n"), []byte("a\nc\nd\n"))
	if !slices.Equal(added, []string{"d"}) || !slices.Equal(removed, []string{"b"}) {
		t.Errorf("lineDiff = %q, %q", added, removed)
	}
}

func TestBinaryKind(t *testing.T) {
	dir := t.TempDir()
	pe := make([]byte, 0x80)
	copy(pe, "MZ")
	pe[0x3c] = 0x40
	copy(pe[0x40:], "PE\x00\x00")
	files := map[string][]byte{
		"elf":    []byte("\x7fELF\x02\x01\x01"),
		"macho":  {0xcf, 0xfa, 0xed, 0xfe, 7, 0, 0, 1},
		"pe":     pe,
		"text":   []byte("MZ is only two letters here, and no PE header follows in this file at all...."),
		"empty":  nil,
		"script": []byte("#!/usr/bin/env bash\necho hi\n"),
	}
	want := map[string]string{"elf": "ELF", "macho": "Mach-O", "pe": "PE"}
	for name, data := range files {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := binaryKind(p)
		if err != nil {
			t.Fatal(err)
		}
		if got != want[name] {
			t.Errorf("binaryKind(%s) = %q, want %q", name, got, want[name])
		}
	}
}

func TestChangelogRelease(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	if err := os.WriteFile("CHANGELOG.md", []byte("# Changelog\n\n## [Unreleased]\n\n### Added\n\n- a\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := changelogRelease("v0.3.0"); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile("CHANGELOG.md")
	lines := splitLines(data)
	if lines[2] != "## [Unreleased]" || !strings.HasPrefix(lines[4], "## [0.3.0] - 2") || lines[6] != "### Added" {
		t.Errorf("CHANGELOG.md after release:\n%s", data)
	}
}
