package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
)

// maxTracked is the largest file the repository may track.
const maxTracked = 1 << 20 // 1 MiB

// hygiene fails on a tracked file over maxTracked or an executable binary
// (ELF, Mach-O, PE): build outputs belong in .gitignore, not in git.
func hygiene() error {
	out, err := exec.Command("git", "ls-files", "-z").Output()
	if err != nil {
		return fmt.Errorf("git ls-files: %w", err)
	}
	var problems []string
	for name := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		info, err := os.Lstat(name)
		if errors.Is(err, os.ErrNotExist) {
			continue // deleted in the working tree
		} else if err != nil {
			return err
		}
		if !info.Mode().IsRegular() {
			continue
		}
		if info.Size() > maxTracked {
			problems = append(problems, fmt.Sprintf("%s: %d bytes, over 1 MiB", name, info.Size()))
		}
		if kind, err := binaryKind(name); err != nil {
			return err
		} else if kind != "" {
			problems = append(problems, fmt.Sprintf("%s: a compiled %s executable", name, kind))
		}
	}
	if len(problems) > 0 {
		return errors.New("tracked files that do not belong in git (git rm --cached them and extend .gitignore):\n  " +
			strings.Join(problems, "\n  "))
	}
	return nil
}

// binaryKind names the executable format of a file by its magic number,
// or returns "".
func binaryKind(name string) (string, error) {
	f, err := os.Open(name)
	if err != nil {
		return "", err
	}
	defer f.Close()
	head := make([]byte, 64)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", err
	}
	head = head[:n]
	switch {
	case bytes.HasPrefix(head, []byte("\x7fELF")):
		return "ELF", nil
	case len(head) >= 4 && isMachO(binary.BigEndian.Uint32(head)):
		return "Mach-O", nil
	case len(head) >= 0x40 && bytes.HasPrefix(head, []byte("MZ")):
		// A PE file: "MZ", and at 0x3c the offset of "PE\0\0".
		off := int64(binary.LittleEndian.Uint32(head[0x3c:]))
		sig := make([]byte, 4)
		if _, err := f.ReadAt(sig, off); err == nil && string(sig) == "PE\x00\x00" {
			return "PE", nil
		}
	}
	return "", nil
}

func isMachO(magic uint32) bool {
	switch magic {
	case 0xfeedface, 0xfeedfacf, 0xcefaedfe, 0xcffaedfe: // 32 and 64 bit, either byte order
		return true
	case 0xcafebabe: // a universal binary (or a Java class: not expected here either)
		return true
	}
	return false
}
