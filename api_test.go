package idem_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// publicPackages are the folders of the packages users import: every type
// they name is defined there (go doc and pkg.go.dev show an alias with
// neither fields nor methods), and no exported identifier is declared as an
// identifier of an internal package.
var publicPackages = []string{".", "idemsql", "idemhttp", "idemgrpc", "idemconnect", "idemui"}

func TestPublicAPIDefinesItsTypes(t *testing.T) {
	for _, dir := range publicPackages {
		fset := token.NewFileSet()
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil || len(files) == 0 {
			t.Fatalf("%s: no Go files (%v)", dir, err)
		}
		for _, name := range files {
			if strings.HasSuffix(name, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			for _, msg := range apiViolations(f) {
				t.Errorf("%s: %s", name, msg)
			}
		}
	}
}

// TestAPICheckCatches proves the check above fails on what it forbids.
func TestAPICheckCatches(t *testing.T) {
	src := `package p
import (
	"example.com/m/internal/core"
	"time"
)
type Config = core.Config
type Scope core.Scope
type Local = time.Duration
type ok struct{}
type unexported = core.Config
const DefaultTTL = core.DefaultTTL
const Fine = 2 * time.Second
var ErrX = core.ErrX
var ErrY = fmt(core.ErrX)
var errZ = core.ErrX
type Options struct {
	Name  string
	Store core.Store
	inner core.Store
}
func Open(c core.Config) error { return nil }
func open(c core.Config) error { return nil }
func (o *Options) Use(c core.Config) {}
`
	f, err := parser.ParseFile(token.NewFileSet(), "p.go", src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	got := apiViolations(f)
	want := []string{"Config", "Scope", "Local", "DefaultTTL", "ErrX", "ErrY", "Options", "Open", "Use"}
	if len(got) != len(want) {
		t.Fatalf("violations %q, want one for each of %q", got, want)
	}
	for i, w := range want {
		if !strings.HasPrefix(got[i], w+" ") {
			t.Errorf("violation %d is %q, want one about %s", i, got[i], w)
		}
	}
}

// apiViolations lists the exported declarations of f that are type
// aliases or that name an identifier of an internal package.
func apiViolations(f *ast.File) []string {
	internal := map[string]bool{} // names of f's imports of internal packages
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		if !strings.Contains("/"+path+"/", "/internal/") {
			continue
		}
		name := path[strings.LastIndex(path, "/")+1:]
		if imp.Name != nil {
			name = imp.Name.Name
		}
		internal[name] = true
	}
	namesInternal := func(n ast.Node) (pkg string) {
		if n == nil {
			return ""
		}
		ast.Inspect(n, func(n ast.Node) bool {
			if sel, ok := n.(*ast.SelectorExpr); ok {
				if id, ok := sel.X.(*ast.Ident); ok && internal[id.Name] && pkg == "" {
					pkg = id.Name + "." + sel.Sel.Name
				}
			}
			return pkg == ""
		})
		return pkg
	}
	var out []string
	for _, d := range f.Decls {
		if fn, ok := d.(*ast.FuncDecl); ok {
			if fn.Name.IsExported() && (fn.Recv == nil || exportedRecv(fn.Recv)) {
				if pkg := namesInternal(fn.Type); pkg != "" {
					out = append(out, fn.Name.Name+" has "+pkg+", an internal type, in its signature")
				}
			}
			continue
		}
		g, ok := d.(*ast.GenDecl)
		if !ok {
			continue
		}
		for _, s := range g.Specs {
			switch s := s.(type) {
			case *ast.TypeSpec:
				if !s.Name.IsExported() {
					continue
				}
				if s.Assign.IsValid() {
					out = append(out, s.Name.Name+" is a type alias; define the type here")
				} else if sel, ok := s.Type.(*ast.SelectorExpr); ok && namesInternal(sel) != "" {
					out = append(out, s.Name.Name+" is defined as "+namesInternal(sel)+", an internal type")
				} else if st, ok := s.Type.(*ast.StructType); ok {
					for _, field := range st.Fields.List {
						exported := len(field.Names) == 0 // embedded
						for _, n := range field.Names {
							exported = exported || n.IsExported()
						}
						if pkg := namesInternal(field.Type); exported && pkg != "" {
							out = append(out, s.Name.Name+" has a field of "+pkg+", an internal type")
						}
					}
				}
			case *ast.ValueSpec:
				for i, name := range s.Names {
					if !name.IsExported() {
						continue
					}
					var value ast.Node
					if i < len(s.Values) {
						value = s.Values[i]
					}
					if pkg := namesInternal(value); pkg != "" {
						out = append(out, name.Name+" is declared as "+pkg+", an identifier of an internal package")
					} else if pkg := namesInternal(s.Type); pkg != "" {
						out = append(out, name.Name+" has the internal type "+pkg)
					}
				}
			}
		}
	}
	return out
}

// exportedRecv reports whether a method's receiver type is exported.
func exportedRecv(recv *ast.FieldList) bool {
	t := recv.List[0].Type
	if star, ok := t.(*ast.StarExpr); ok {
		t = star.X
	}
	if idx, ok := t.(*ast.IndexExpr); ok {
		t = idx.X
	}
	id, ok := t.(*ast.Ident)
	return ok && id.IsExported()
}
