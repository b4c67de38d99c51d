package main

import (
	"bytes"
	"errors"
	"fmt"
	"go/types"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/tools/go/packages"
)

// The listing of a module's public API, api/<name>.txt, has one line per
// exported identifier of its public packages (every package but internal
// ones and commands), sorted:
//
//	pkg github.com/pgidem/idem, func DoInTx(context.Context, Beginner, Scope, string, Fingerprint, func(context.Context, pgx.Tx) (Response, error)) (Result, error)
//	pkg github.com/pgidem/idem, type Config struct
//	pkg github.com/pgidem/idem, type Config struct, TTL time.Duration
//	pkg github.com/pgidem/idem, method (*RejectedError) Decode(any) error
//
// Parameter names are left out (renaming one changes nothing for a
// caller). A type alias is listed as such, with the fields and methods of
// the type it names. api/released/ holds the listing of the last release,
// copied there by tools/release.

const apiDir = "api"

// apiCommand writes the listings, or with check compares them with the
// committed ones and the last release's.
func apiCommand(check bool) error {
	listings, err := apiListings()
	if err != nil {
		return err
	}
	if !check {
		if err := os.MkdirAll(apiDir, 0o755); err != nil {
			return err
		}
		for name, text := range listings {
			if err := os.WriteFile(filepath.Join(apiDir, name+".txt"), text, 0o644); err != nil {
				return err
			}
		}
		return nil
	}
	var problems []string
	for _, name := range sortedKeys(listings) {
		file := filepath.Join(apiDir, name+".txt")
		committed, err := os.ReadFile(file)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if !bytes.Equal(committed, listings[name]) {
			added, removed := lineDiff(committed, listings[name])
			problems = append(problems, fmt.Sprintf("%s is not the public API of the code (run tools/api and commit it):%s%s",
				file, prefixed("\n  + ", added), prefixed("\n  - ", removed)))
		}
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "\n"))
	}
	return checkBreaking(listings)
}

// checkBreaking compares the listings with the last release's: a line of
// the release that is gone (a removal or a changed signature) needs an entry
// under "### Breaking" in CHANGELOG.md's Unreleased section.
func checkBreaking(listings map[string][]byte) error {
	version, err := os.ReadFile(filepath.Join(apiDir, "released", "VERSION"))
	if errors.Is(err, os.ErrNotExist) {
		return nil // nothing released yet: nothing promised
	} else if err != nil {
		return err
	}
	var gone []string
	for _, name := range sortedKeys(listings) {
		old, err := os.ReadFile(filepath.Join(apiDir, "released", name+".txt"))
		if errors.Is(err, os.ErrNotExist) {
			continue // a module released for the first time
		} else if err != nil {
			return err
		}
		_, removed := lineDiff(old, listings[name])
		gone = append(gone, removed...)
	}
	if len(gone) == 0 {
		return nil
	}
	changelog, err := os.ReadFile("CHANGELOG.md")
	if err != nil {
		return err
	}
	if len(breakingEntries(string(changelog))) > 0 {
		return nil
	}
	return fmt.Errorf("the public API lost what %s had (a removal or a changed signature); "+
		"say so in an entry under \"### Breaking\" in CHANGELOG.md's Unreleased section:%s",
		strings.TrimSpace(string(version)), prefixed("\n  - ", gone))
}

// breakingEntries returns the list items under "### Breaking" in the
// Unreleased section of a changelog.
func breakingEntries(changelog string) []string {
	var entries []string
	inUnreleased, inBreaking := false, false
	for line := range strings.SplitSeq(changelog, "\n") {
		switch {
		case strings.HasPrefix(line, "## "):
			inUnreleased = strings.Contains(strings.ToLower(line), "unreleased")
			inBreaking = false
		case strings.HasPrefix(line, "### "):
			inBreaking = inUnreleased && strings.EqualFold(strings.TrimSpace(line[4:]), "Breaking")
		case inBreaking && (strings.HasPrefix(line, "- ") || strings.HasPrefix(line, "* ")):
			entries = append(entries, line)
		}
	}
	return entries
}

// apiListings loads the public packages of every module with a listing and
// returns each listing by name.
func apiListings() (map[string][]byte, error) {
	var patterns []string
	byPath := map[string]mod{}
	for _, m := range modules {
		if m.api != "" {
			patterns = append(patterns, "./"+strings.TrimPrefix(m.dir+"/...", "./"))
			byPath[m.path] = m
		}
	}
	cfg := &packages.Config{Mode: packages.NeedName | packages.NeedModule | packages.NeedTypes}
	pkgs, err := packages.Load(cfg, patterns...)
	if err != nil {
		return nil, err
	}
	lines := map[string][]string{}
	for _, m := range byPath {
		lines[m.api] = nil
	}
	for _, p := range pkgs {
		if len(p.Errors) > 0 {
			return nil, fmt.Errorf("%s: %v", p.PkgPath, p.Errors[0])
		}
		if p.Module == nil || p.Name == "main" || isInternal(p.PkgPath) {
			continue
		}
		m, ok := byPath[p.Module.Path]
		if !ok {
			continue
		}
		lines[m.api] = append(lines[m.api], packageAPI(p.Types)...)
	}
	out := map[string][]byte{}
	for name, l := range lines {
		slices.Sort(l)
		l = slices.Compact(l)
		out[name] = []byte(strings.Join(l, "\n") + "\n")
	}
	return out, nil
}

func isInternal(path string) bool {
	return strings.HasSuffix(path, "/internal") || strings.Contains(path, "/internal/")
}

// packageAPI lists the exported identifiers of pkg.
func packageAPI(pkg *types.Package) []string {
	w := &apiWriter{pkg: pkg}
	prefix := "pkg " + pkg.Path() + ", "
	var out []string
	emit := func(s string) { out = append(out, prefix+s) }
	scope := pkg.Scope()
	for _, name := range scope.Names() {
		obj := scope.Lookup(name)
		if !obj.Exported() {
			continue
		}
		switch obj := obj.(type) {
		case *types.Const:
			if b, ok := obj.Type().(*types.Basic); ok && b.Info()&types.IsUntyped != 0 {
				emit(fmt.Sprintf("const %s = %s", name, obj.Val().ExactString()))
			} else {
				emit(fmt.Sprintf("const %s %s = %s", name, w.typ(obj.Type()), obj.Val().ExactString()))
			}
		case *types.Var:
			emit(fmt.Sprintf("var %s %s", name, w.typ(obj.Type())))
		case *types.Func:
			sig := obj.Type().(*types.Signature)
			emit(fmt.Sprintf("func %s%s%s", name, w.typeParams(sig.TypeParams()), w.signature(sig)))
		case *types.TypeName:
			for _, l := range w.typeName(obj) {
				emit(l)
			}
		}
	}
	return out
}

type apiWriter struct{ pkg *types.Package }

// typeName lists a type: its kind, fields or interface methods, and the
// exported methods of its method set (promoted ones included).
func (w *apiWriter) typeName(obj *types.TypeName) []string {
	name := obj.Name()
	var out []string
	t := obj.Type()
	var head string
	if obj.IsAlias() {
		head = "type " + name + " = " + w.typ(types.Unalias(t))
	} else {
		tparams := ""
		if n, ok := t.(*types.Named); ok {
			tparams = w.typeParams(n.TypeParams())
		}
		head = "type " + name + tparams + " " + w.kind(t.Underlying())
	}
	out = append(out, head)
	under := types.Unalias(t).Underlying()
	kindHead := "type " + name + " " + w.kind(under)
	switch u := under.(type) {
	case *types.Struct:
		for i := range u.NumFields() {
			f := u.Field(i)
			if !f.Exported() {
				continue
			}
			if f.Embedded() {
				out = append(out, kindHead+", embedded "+w.typ(f.Type()))
			} else {
				out = append(out, kindHead+", "+f.Name()+" "+w.typ(f.Type()))
			}
		}
	case *types.Interface:
		for i := range u.NumMethods() {
			m := u.Method(i)
			if m.Exported() {
				out = append(out, kindHead+", "+m.Name()+w.signature(m.Type().(*types.Signature)))
			} else {
				out = append(out, kindHead+", unexported methods")
			}
		}
		return slices.Compact(out)
	}
	recv := name
	if n, ok := types.Unalias(t).(*types.Named); ok && n.TypeParams().Len() > 0 && !obj.IsAlias() {
		var ps []string
		for i := range n.TypeParams().Len() {
			ps = append(ps, n.TypeParams().At(i).Obj().Name())
		}
		recv += "[" + strings.Join(ps, ", ") + "]"
	}
	value := types.NewMethodSet(t)
	for i := range value.Len() {
		m := value.At(i).Obj()
		if m.Exported() {
			out = append(out, fmt.Sprintf("method (%s) %s%s", recv, m.Name(), w.signature(m.Type().(*types.Signature))))
		}
	}
	ptr := types.NewMethodSet(types.NewPointer(t))
	for i := range ptr.Len() {
		m := ptr.At(i).Obj()
		if m.Exported() && value.Lookup(m.Pkg(), m.Name()) == nil {
			out = append(out, fmt.Sprintf("method (*%s) %s%s", recv, m.Name(), w.signature(m.Type().(*types.Signature))))
		}
	}
	return out
}

// kind is the head of a type's underlying type: "struct", "interface { M; N }",
// or the type itself.
func (w *apiWriter) kind(t types.Type) string {
	switch u := t.(type) {
	case *types.Struct:
		return "struct"
	case *types.Interface:
		var names []string
		for i := range u.NumMethods() {
			if u.Method(i).Exported() {
				names = append(names, u.Method(i).Name())
			}
		}
		if u.NumMethods() > len(names) {
			names = append(names, "unexported methods")
		}
		for i := range u.NumEmbeddeds() {
			if _, ok := u.EmbeddedType(i).Underlying().(*types.Interface); !ok {
				names = append(names, w.typ(u.EmbeddedType(i))) // a type set term
			}
		}
		if len(names) == 0 {
			return "interface {}"
		}
		return "interface { " + strings.Join(names, "; ") + " }"
	}
	return w.typ(t)
}

func (w *apiWriter) typeParams(tp *types.TypeParamList) string {
	if tp.Len() == 0 {
		return ""
	}
	var ps []string
	for i := range tp.Len() {
		p := tp.At(i)
		ps = append(ps, p.Obj().Name()+" "+w.typ(p.Constraint()))
	}
	return "[" + strings.Join(ps, ", ") + "]"
}

// signature writes a function's parameters and results without their names.
func (w *apiWriter) signature(sig *types.Signature) string {
	params := w.tuple(sig.Params(), sig.Variadic())
	switch r := sig.Results(); r.Len() {
	case 0:
		return "(" + params + ")"
	case 1:
		return "(" + params + ") " + w.typ(r.At(0).Type())
	default:
		return "(" + params + ") (" + w.tuple(r, false) + ")"
	}
}

func (w *apiWriter) tuple(t *types.Tuple, variadic bool) string {
	var s []string
	for i := range t.Len() {
		typ := t.At(i).Type()
		if variadic && i == t.Len()-1 {
			s = append(s, "..."+w.typ(typ.(*types.Slice).Elem()))
		} else {
			s = append(s, w.typ(typ))
		}
	}
	return strings.Join(s, ", ")
}

// typ writes a type, qualified by package name outside pkg, with no
// parameter names in function types.
func (w *apiWriter) typ(t types.Type) string {
	switch t := t.(type) {
	case *types.Signature:
		return "func" + w.signature(t)
	case *types.Pointer:
		return "*" + w.typ(t.Elem())
	case *types.Slice:
		return "[]" + w.typ(t.Elem())
	case *types.Array:
		return fmt.Sprintf("[%d]%s", t.Len(), w.typ(t.Elem()))
	case *types.Map:
		return "map[" + w.typ(t.Key()) + "]" + w.typ(t.Elem())
	case *types.Chan:
		switch t.Dir() {
		case types.SendOnly:
			return "chan<- " + w.typ(t.Elem())
		case types.RecvOnly:
			return "<-chan " + w.typ(t.Elem())
		}
		return "chan " + w.typ(t.Elem())
	case *types.Named:
		s := w.qualify(t.Obj())
		if args := t.TypeArgs(); args.Len() > 0 {
			var a []string
			for i := range args.Len() {
				a = append(a, w.typ(args.At(i)))
			}
			s += "[" + strings.Join(a, ", ") + "]"
		}
		return s
	case *types.Alias:
		return w.qualify(t.Obj())
	}
	return types.TypeString(t, w.qualifier)
}

func (w *apiWriter) qualify(obj *types.TypeName) string {
	if obj.Pkg() == nil || obj.Pkg() == w.pkg {
		return obj.Name()
	}
	return obj.Pkg().Name() + "." + obj.Name()
}

func (w *apiWriter) qualifier(p *types.Package) string {
	if p == w.pkg {
		return ""
	}
	return p.Name()
}

// lineDiff returns the lines of b not in a, and the lines of a not in b.
func lineDiff(a, b []byte) (added, removed []string) {
	as, bs := splitLines(a), splitLines(b)
	inA, inB := map[string]bool{}, map[string]bool{}
	for _, l := range as {
		inA[l] = true
	}
	for _, l := range bs {
		inB[l] = true
		if !inA[l] {
			added = append(added, l)
		}
	}
	for _, l := range as {
		if !inB[l] {
			removed = append(removed, l)
		}
	}
	return added, removed
}

func splitLines(b []byte) []string {
	s := strings.TrimRight(string(b), "\n")
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func prefixed(prefix string, lines []string) string {
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(prefix + l)
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
