package snippets

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/scanner"
	"go/token"
	"go/types"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// root is the repository's root, seen from this package's folder.
const root = "../.."

// block is one fenced code block of a Markdown file.
type block struct {
	doc  string // the Markdown file, relative to root
	line int    // the line of its first code line in doc
	lang string // the first word of the fence's info string
	text string // the code, without the fence's indentation
}

func (b block) String() string { return fmt.Sprintf("%s:%d", b.doc, b.line) }

var fence = regexp.MustCompile("^( *)(```+|~~~+)[ \t]*([^ \t`]*)")

// readBlocks returns the fenced code blocks of a Markdown file.
func readBlocks(doc string) ([]block, error) {
	src, err := os.ReadFile(filepath.Join(root, doc))
	if err != nil {
		return nil, err
	}
	var (
		blocks []block
		open   *block
		indent int
		marker string
		lines  []string
	)
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if open == nil {
			if m := fence.FindStringSubmatch(line); m != nil {
				open = &block{doc: doc, line: n + 1, lang: m[3]}
				indent, marker, lines = len(m[1]), m[2], nil
			}
			continue
		}
		trimmed := strings.TrimLeft(line, " ")
		if strings.HasPrefix(trimmed, marker) && strings.TrimSpace(strings.TrimLeft(trimmed, marker[:1])) == "" {
			open.text = strings.Join(lines, "\n") + "\n"
			blocks = append(blocks, *open)
			open = nil
			continue
		}
		for i := 0; i < indent && strings.HasPrefix(line, " "); i++ {
			line = line[1:]
		}
		lines = append(lines, line)
	}
	if open != nil {
		return nil, fmt.Errorf("%s: the code block opened at line %d is never closed", doc, open.line-1)
	}
	return blocks, sc.Err()
}

// docs lists README.md and every Markdown file under docs/.
func docs(t *testing.T) []string {
	list := []string{"README.md"}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(path, ".md") {
			rel, _ := filepath.Rel(root, path)
			list = append(list, filepath.ToSlash(rel))
		}
		return err
	})
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return list
}

// inFile matches the first line of a block that names the file it belongs to.
var inFile = regexp.MustCompile(`^//\s*(?:in|file):\s*(\S+)\s*$`)

// unit is what one Go block compiles as: a file of its own, or the file it
// names with the block added.
type unit struct {
	b      block
	home   string // the file the block belongs to, relative to root; "" for a whole file
	file   string // the source of home
	src    string // the source type-checked
	offset int    // the line of src that holds the block's first line, minus one
}

// assemble turns a Go block into the source it compiles as.
func assemble(b block) (unit, error) {
	first, _, _ := strings.Cut(b.text, "\n")
	if m := inFile.FindStringSubmatch(strings.TrimSpace(first)); m != nil {
		home := filepath.ToSlash(filepath.Clean(m[1]))
		src, err := os.ReadFile(filepath.Join(root, home))
		if err != nil {
			return unit{}, fmt.Errorf("%s names %s, which cannot be read: %v", b, m[1], err)
		}
		u := unit{b: b, home: home, file: string(src)}
		if !strings.HasSuffix(u.file, "\n") {
			u.file += "\n"
		}
		u.src = u.file
		u.offset = strings.Count(u.src, "\n")
		if _, err := parser.ParseFile(token.NewFileSet(), "", "package p\n"+b.text, parser.SkipObjectResolution); err == nil {
			u.src += b.text // declarations
		} else {
			u.src += "func _() {\n" + b.text + "}\n" // statements: a function body
			u.offset++
		}
		return u, nil
	}
	if _, err := parser.ParseFile(token.NewFileSet(), "", b.text, parser.PackageClauseOnly); err != nil {
		return unit{}, fmt.Errorf("%s: a Go block is either a whole file (it begins with its package clause) "+
			"or names on its first line the examples file it belongs to (// in: examples/snippets/NAME.go); this one does neither", b)
	}
	return unit{b: b, src: b.text}, nil
}

// exports compiles the packages the units import, and those they import in
// turn, and returns where the export data of each is (`go list -export`).
func exports(t *testing.T, imports []string) map[string]string {
	t.Helper()
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to compile the packages the docs import: %v", err)
	}
	args := append([]string{"list", "-e", "-export", "-deps", "-json=ImportPath,Export,Error"}, imports...)
	cmd := exec.Command(goCmd, args...)
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -export: %v", err)
	}
	paths := map[string]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath, Export string
			Error              *struct{ Err string }
		}
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if p.Export != "" {
			paths[p.ImportPath] = p.Export
		} else if p.Error != nil && slices.Contains(imports, p.ImportPath) {
			t.Logf("cannot import %s: %s", p.ImportPath, p.Error.Err)
		}
	}
	return paths
}

// TestDocsCompile type-checks every Go block of README.md and docs/: a block
// that begins with a package clause as a file of its own, a block whose
// first line is "// in: <file>" as part of that file (its declarations, or
// its statements as the body of a function), with that file's imports and
// helpers. The files blocks name are type-checked on their own too.
func TestDocsCompile(t *testing.T) {
	var units []unit
	homes := map[string]bool{}
	for _, doc := range docs(t) {
		blocks, err := readBlocks(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range blocks {
			if b.lang != "go" {
				continue
			}
			u, err := assemble(b)
			if err != nil {
				t.Error(err)
				continue
			}
			units = append(units, u)
			if u.home != "" && !homes[u.home] {
				homes[u.home] = true
				units = append(units, unit{home: u.home, src: u.file, offset: strings.Count(u.file, "\n")})
			}
		}
	}
	if len(units) == 0 {
		t.Fatal("no Go blocks found in README.md and docs/")
	}

	fset := token.NewFileSet()
	files := make([]*ast.File, len(units))
	var imports []string
	for i, u := range units {
		f, err := parser.ParseFile(fset, where(u, 1), u.src, parser.SkipObjectResolution)
		var list scanner.ErrorList
		if errors.As(err, &list) {
			for _, e := range list {
				t.Errorf("%s: %s", where(u, e.Pos.Line), e.Msg)
			}
			continue
		} else if err != nil {
			t.Fatal(err)
		}
		files[i] = f
		for _, spec := range f.Imports {
			if p, err := strconv.Unquote(spec.Path.Value); err == nil && !slices.Contains(imports, p) {
				imports = append(imports, p)
			}
		}
	}
	export := exports(t, imports)
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := export[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %s (go list -export found none)", path)
		}
		return os.Open(file)
	})

	for i, u := range units {
		if files[i] == nil {
			continue
		}
		var errs []string
		conf := types.Config{Importer: imp, Error: func(err error) {
			te := err.(types.Error)
			pos := fset.Position(te.Pos)
			if u.home != "" && pos.Line <= u.offset && unusedImport.MatchString(te.Msg) {
				return // the block need not use every import of its file
			}
			errs = append(errs, fmt.Sprintf("%s: %s", where(u, pos.Line), te.Msg))
		}}
		_, _ = conf.Check("snippet", fset, []*ast.File{files[i]}, nil)
		for _, e := range errs {
			t.Error(e)
		}
	}
}

// unusedImport matches go/types' message for an import the file does not use.
var unusedImport = regexp.MustCompile(`^".*" imported( as \w+)? and not used$`)

// where names the line of the Markdown file (or of the examples file) that
// holds line n of a unit's source.
func where(u unit, n int) string {
	switch {
	case u.b.doc == "":
		return fmt.Sprintf("%s:%d", u.home, n)
	case u.home != "" && n <= u.offset:
		return fmt.Sprintf("%s:%d (with the block of %s)", u.home, n, u.b)
	default:
		return fmt.Sprintf("%s:%d", u.b.doc, u.b.line+n-u.offset-1)
	}
}
